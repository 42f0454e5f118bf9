"""GPU smoke test: the CUDA compile path on a tiny model (canary) and the 8B shape (compile + steps)."""

import sys
import tempfile
import time

import torch


def main() -> None:
    import autodeploy
    from autodeploy.check import run_check
    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig
    from autodeploy.kvcache.metadata import SequenceChunk
    from autodeploy.tiny import make_tiny_checkpoint
    from transformers import LlamaConfig

    print("torch", torch.__version__, "device", torch.cuda.get_device_name(0), flush=True)
    tmp = tempfile.mkdtemp()
    make_tiny_checkpoint("llama", tmp)
    for backend in sys.argv[1:] or ["torch"]:
        res = run_check(tmp, device="cuda", attention_backend=backend)
        print(f"tiny llama canary on cuda ({backend}):", res.summary(), flush=True)

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0, dtype="bfloat16")
    start = time.perf_counter()
    model = compile_config(cfg, CompileConfig(weights="random", dtype="bfloat16", device="cuda", max_seq_len=2048,
                                              max_batch_size=64, num_kv_blocks=4096,
                                              attention_backend=(sys.argv[1:] or ["torch"])[-1]))
    print(f"8B compile {time.perf_counter() - start:.1f} s", model.report.stage_seconds, flush=True)
    print(model.report.pass_table(), flush=True)
    for bs in (1, 64):
        chunks = [SequenceChunk((1,), 512, tuple(range(b * 40, b * 40 + 33))) for b in range(bs)]
        for _ in range(3):
            model(chunks).argmax(-1).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            model(chunks).argmax(-1).tolist()
        print(f"8B decode bs={bs} ctx=512: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
