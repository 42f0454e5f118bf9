"""Decode-step benchmark on one GPU, peers side by side, with the bandwidth roofline of the same run.

For each model shape (random bf16 weights made on the GPU) and batch size, with every sequence at
``--context`` cached tokens, one decode step (one new token per sequence, including reading the
sampled ids back to the host, as an engine step does) is timed for:

- ``hf_eager``:   transformers, default attention, DynamicCache
- ``hf_static``:  transformers with StaticCache + ``torch.compile(mode="reduce-overhead")``
- ``autodeploy``: the compiled model (attention backend from ``--backend``, CUDA graphs), one bare
  step after the other (metadata built and sampled ids read back between steps, serially)
- ``autodeploy_engine``: the same model driven by the serving engine in steady state (scheduling,
  metadata, greedy sampling, bookkeeping; with async scheduling they overlap the device's work)

and printed as ms/step, output tokens/s and the share of the roofline: bytes that must be streamed
per step (all linear weights incl. the LM head, plus the KV cache read) / measured copy bandwidth.

    python bench/decode_bench.py --shapes llama8b,smollm2 --batches 1,8,64,256 --static-batches 1,64
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                    tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True),
}


@dataclass
class Row:
    shape: str
    batch: int
    impl: str
    ms_per_step: float
    floor_ms: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e3 / self.ms_per_step

    @property
    def roofline_share(self) -> float:
        return self.floor_ms / self.ms_per_step


def llama_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], dtype="bfloat16")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), like the anchors."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * src.numel() * 20 / (start.elapsed_time(end) / 1e3)
    del src, dst
    return bw


def streamed_bytes(cfg, batch: int, context: int) -> int:
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k+v, o, gate+up+down
    weights = 2 * (layers * per_layer + cfg.vocab_size * h)  # bf16, LM head read every step
    kv_cache = 2 * layers * batch * context * 2 * kv
    return weights + kv_cache


def timed_steps(step, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def hf_model(cfg, attn_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    return model.eval()


@torch.inference_mode()
def bench_hf_eager(model, batch: int, context: int, steps: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    out = model(ids, use_cache=True, logits_to_keep=1)
    state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1)}

    def step():
        out = model(state["next"][:, None], past_key_values=state["past"], use_cache=True)
        state["next"] = out.logits[:, -1].argmax(-1)
        state["next"].tolist()

    return timed_steps(step, steps)


@torch.inference_mode()
def bench_hf_static(model, batch: int, context: int, steps: int) -> tuple[float, float]:
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + steps + 16)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                cache_position=torch.arange(context, device="cuda"))
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    state = {"next": out.logits[:, -1].argmax(-1), "pos": context}

    def step():
        pos = torch.tensor([state["pos"]], device="cuda")
        out = forward(state["next"][:, None], past_key_values=cache, use_cache=True, cache_position=pos)
        state["next"] = out.logits[:, -1].argmax(-1)
        state["next"].tolist()
        state["pos"] = min(state["pos"] + 1, context + steps + 8)

    start = time.perf_counter()
    step()
    step()
    compile_s = time.perf_counter() - start
    return timed_steps(step, steps), compile_s


def compile_autodeploy(cfg, max_batch: int, context: int, backend: str, settings: tuple[str, ...] = ()):
    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig, parse_set_option, set_dotted

    block = 16
    # room past the context for the engine rows: their first prompts decode while later ones prefill
    max_seq_len = context + 64
    blocks = max_batch * (-(-max_seq_len // block)) + 1
    fields = dict(weights="random", dtype="bfloat16", device="cuda", max_batch_size=max_batch,
                  max_seq_len=max_seq_len, num_kv_blocks=blocks, tokens_per_block=block, attention_backend=backend)
    for item in settings:  # --set passes.fuse_norm_linear.enabled=false
        set_dotted(fields, *parse_set_option(item))
    config = CompileConfig(**fields)
    start = time.perf_counter()
    model = compile_config(cfg, config)
    return model, time.perf_counter() - start


@torch.inference_mode()
def decode_chunks(model, batch: int, context: int, seed: int = 0) -> list:
    """A decode step of ``batch`` sequences with ``context`` cached tokens each, over a KV pool of
    random values and random token ids: a pool of zeros and identical rows draw less power and run
    faster than real data (METHOD.md), which flattered earlier bare-step numbers."""
    from autodeploy.kvcache.metadata import SequenceChunk

    gen = torch.Generator(device=model.device).manual_seed(seed)
    for cache in model.pool.caches:
        cache.normal_(generator=gen)
    ids = torch.randint(0, model.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    per_seq = -(-(context + 32) // model.block_size)
    return [SequenceChunk((ids[b],), context, tuple(range(b * per_seq + 1, (b + 1) * per_seq + 1))) for b in range(batch)]


@torch.inference_mode()
def bench_autodeploy(model, batch: int, context: int, steps: int) -> float:
    chunks = decode_chunks(model, batch, context)

    def step():
        model(chunks).argmax(-1).tolist()

    return timed_steps(step, steps)


def bench_engine(model, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(ms per step, ms per step the host spent waiting for the device)."""
    from autodeploy.serve.bench import engine_decode_step_ms

    timing = engine_decode_step_ms(model, batch, context - 4, steps)  # prompt + a few tokens ~ context
    return timing.ms, timing.waited_ms


def run_shape(shape: str, args, bandwidth: float) -> Iterator[Row]:
    """Each row as soon as it is measured (a caller saving rows keeps them if the run is cut short)."""
    cfg = llama_config(shape)
    batches = [int(b) for b in args.batches.split(",")]
    static_batches = {int(b) for b in args.static_batches.split(",") if b}
    floor = {b: streamed_bytes(cfg, b, args.context) / bandwidth * 1e3 for b in batches}
    if "hf" in args.impls:
        model = hf_model(cfg)
        for b in batches:
            yield Row(shape, b, "hf_eager", bench_hf_eager(model, b, args.context, args.steps), floor[b])
            if b in static_batches:
                ms, compile_s = bench_hf_static(model, b, args.context, args.steps)
                yield Row(shape, b, "hf_static_compile", ms, floor[b], f"first calls {compile_s:.0f} s")
                torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if "autodeploy" in args.impls:
        model, compile_s = compile_autodeploy(cfg, max(batches), args.context, args.backend, tuple(args.set))
        print(model.report.pass_table(), flush=True)
        note = f"compile {compile_s:.0f} s"
        for b in batches:
            yield Row(shape, b, "autodeploy" + args.label, bench_autodeploy(model, b, args.context, args.steps),
                      floor[b], note)
            if "engine" in args.impls:
                ms, waited = bench_engine(model, b, args.context, args.steps)
                yield Row(shape, b, "autodeploy_engine" + args.label, ms, floor[b],
                          f"host waited {waited:.2f} ms/step")
        del model
        gc.collect()
        torch.cuda.empty_cache()


def print_table(rows: list[Row], bandwidth: float) -> None:
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; roofline = bytes streamed per step / that bandwidth")
    print(f"{'shape':<9}{'batch':>6} {'impl':<19}{'ms/step':>9}{'tok/s':>10}{'floor ms':>9}{'roofline':>9}  note")
    for r in rows:
        print(f"{r.shape:<9}{r.batch:>6} {r.impl:<19}{r.ms_per_step:>9.3f}{r.tokens_per_s:>10.0f}"
              f"{r.floor_ms:>9.3f}{r.roofline_share:>8.0%}  {r.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama8b,smollm2")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--static-batches", default="1,64", help="batches for HF static cache + torch.compile")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--impls", default="hf,autodeploy,engine", help="hf, autodeploy, engine (with autodeploy)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="compile setting of the autodeploy rows (dotted key), e.g. passes.warm_up.enabled=false")
    parser.add_argument("--label", default="", help="suffix of the autodeploy rows' names (A/B runs)")
    args = parser.parse_args()
    print("torch", torch.__version__, "|", torch.cuda.get_device_name(0), flush=True)
    bandwidth = copy_bandwidth()
    rows = []
    for shape in args.shapes.split(","):
        for row in run_shape(shape, args, bandwidth):
            print(row, flush=True)
            rows.append(row)
    print_table(rows, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]}, f)


if __name__ == "__main__":
    main()
