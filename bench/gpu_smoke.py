"""GPU smoke test: the correctness canary on a tiny model on CUDA, for each attention backend given;
then the engine with async scheduling (CUDA graphs reading the previous step's tokens on the device)
against the engine without it: every request must generate the same tokens.

    python bench/gpu_smoke.py torch triton
"""

import sys
import tempfile

import torch


def main() -> None:
    from autodeploy.check import run_check
    from autodeploy.tiny import make_tiny_checkpoint

    print("torch", torch.__version__, "device", torch.cuda.get_device_name(0), flush=True)
    tmp = tempfile.mkdtemp()
    failed = False
    for arch in ("llama", "gemma2", "qwen3"):
        path = make_tiny_checkpoint(arch, f"{tmp}/{arch}")
        for backend in sys.argv[1:] or ["torch"]:
            res = run_check(path, device="cuda", attention_backend=backend)
            failed |= not res.passed
            print(f"tiny {arch} canary on cuda ({backend}, fp32):", res.summary(), flush=True)
    failed |= not engine_overlap_matches(make_tiny_checkpoint("llama", f"{tmp}/engine"))
    sys.exit(1 if failed else 0)


def engine_overlap_matches(path) -> bool:
    import random

    import autodeploy
    from autodeploy.sampling_params import SamplingParams
    from autodeploy.serve.engine import Engine, EngineConfig

    model = autodeploy.compile(path, device="cuda", dtype="float32", max_batch_size=32, max_seq_len=256)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(rng.randrange(1, 120))] for _ in range(40)]
    stops = tuple(range(3, model.vocab_size, 7))
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=64, stop_token_ids=stops, min_tokens=4)]
    tokens = {}
    for overlap in (False, True):
        engine = Engine(model, None, EngineConfig(overlap=overlap, max_num_tokens=512))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params[i % len(params)])
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids if o.outputs else ())
        tokens[overlap] = out
    same = sum(tokens[True][k] == tokens[False][k] for k in tokens[False])
    print(f"engine with async scheduling vs without (tiny llama, cuda graphs, fp32): {same}/{len(prompts)} "
          f"requests identical, {sum(map(len, tokens[True].values()))} tokens", flush=True)
    return same == len(prompts)


if __name__ == "__main__":
    main()
