"""The suite's decode section: one decode step on one GPU, peers side by side, with the bandwidth floor.

For each model shape (random weights made on the GPU) and batch size, with every sequence at ``--context``
cached tokens, one decode step (one new token per sequence, including reading the sampled ids back to the
host, as an engine step does) is timed for:

- ``hf_eager``:   transformers, default attention, DynamicCache
- ``hf_static``:  transformers with StaticCache + ``torch.compile(mode="reduce-overhead")``
- ``autodeploy bare step``: the compiled model (CUDA graphs), one step after the other (metadata built and
  sampled ids read back between steps, serially)
- ``autodeploy engine``: the same model driven by the serving engine in steady state (scheduling, metadata,
  greedy sampling, bookkeeping; with async scheduling they overlap the device's work): the number that counts

Floor: the bytes a step must stream (every linear weight incl. the LM head, plus the KV cache read) / the
copy bandwidth measured at the start of the run. Also the shared helpers of the other sections (model
shapes, the copy bandwidth, compiling autodeploy, building the HF model).

    python bench/full_table.py --sections decode --shapes llama8b --batches 1,64 --impls autodeploy
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import torch
from table import TableRow

SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                    tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True),
}


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


def streamed_bytes(cfg, batch: int, context: int, bytes_per_weight: float = 2, head_bytes: float = 2,
                   kv_bytes: int = 2) -> float:
    """Bytes one decode step must read: every linear weight (the LM head at ``head_bytes`` a weight) and the
    KV cache (``kv_bytes`` an element: 2 for bf16, 1 for FP8)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k+v, o, gate+up+down
    weights = bytes_per_weight * layers * per_layer + head_bytes * cfg.vocab_size * h
    kv_cache = kv_bytes * layers * batch * context * 2 * kv
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


def compile_autodeploy(cfg, max_batch: int, context: int, settings: dict | None = None, overrides=()):
    """(model, compile seconds): random weights on CUDA, a pool for ``max_batch`` sequences of ``context``
    tokens and some room; ``settings`` are CompileConfig fields (a weight format's), ``overrides`` dotted
    ``key=value`` strings (``--set``)."""
    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig, parse_set_option, set_dotted

    block = 16
    # room past the context for the engine rows: their first prompts decode while later ones prefill
    max_seq_len = context + 64
    blocks = max_batch * (-(-max_seq_len // block)) + 1
    fields = dict(weights="random", dtype="bfloat16", device="cuda", max_batch_size=max_batch,
                  max_seq_len=max_seq_len, num_kv_blocks=blocks, tokens_per_block=block) | (settings or {})
    for item in overrides:  # passes.fuse_norm_linear.enabled=false
        set_dotted(fields, *parse_set_option(item))
    start = time.perf_counter()
    model = compile_config(cfg, CompileConfig(**fields))
    return model, time.perf_counter() - start


@torch.inference_mode()
def decode_chunks(model, batch: int, context: int, seed: int = 0) -> list:
    """A decode step of ``batch`` sequences with ``context`` cached tokens each, over a KV pool of
    random values and random token ids: a pool of zeros and identical rows draw less power and run
    faster than real data (METHOD.md), which flattered earlier bare-step numbers."""
    from autodeploy.kvcache.metadata import SequenceChunk

    gen = torch.Generator(device=model.device).manual_seed(seed)
    for cache in model.pool.caches:
        if cache.dtype == torch.float8_e4m3fn:  # (no random kernels for FP8: values of scale 1.0 cast to e4m3)
            cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device, dtype=torch.bfloat16))
        else:
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


def add_options(group) -> None:
    group.add_argument("--shapes", default="llama8b,smollm2", help="model shapes (SHAPES)")
    group.add_argument("--batches", default="1,8,64,256", help="batch sizes")
    group.add_argument("--static-batches", default="1,8,64,256",
                       help="batches with HF static cache + torch.compile")
    group.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    group.add_argument("--steps", type=int, default=20, help="timed steps")
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="compile setting of the autodeploy rows (dotted key), e.g. "
                       "passes.warm_up.enabled=false")
    group.add_argument("--label", default="", help="suffix of the autodeploy rows' names (A/B runs)")


def table_rows(args, header) -> Iterator[TableRow]:
    for shape in args.shapes.split(","):
        cfg = llama_config(shape)
        batches = [int(b) for b in args.batches.split(",")]
        if {"hf_eager", "hf_static"} & set(args.impls):
            yield from hf_rows(shape, cfg, batches, args, header.bandwidth)
        if "autodeploy" in args.impls:
            for weights in args.weights:
                yield from autodeploy_rows(shape, cfg, batches, weights, args, header.bandwidth)


def _row(shape: str, batch: int, impl: str, ms: float, floor_s: float, note: str = "", weights: str = "bf16"):
    return TableRow("decode", f"{shape} batch {batch}", impl, ms / 1e3, batch * 1e3 / ms, floor_s, note,
                    weights)


def hf_rows(shape: str, cfg, batches: list[int], args, bandwidth: float) -> Iterator[TableRow]:
    """HF eager at every batch, HF static cache + compile at ``--static-batches``; each row when measured."""
    static_batches = {int(b) for b in args.static_batches.split(",") if b}
    model = hf_model(cfg)
    for b in batches:
        floor = streamed_bytes(cfg, b, args.context) / bandwidth
        if "hf_eager" in args.impls:
            yield _row(shape, b, "hf_eager", bench_hf_eager(model, b, args.context, args.steps), floor)
        if "hf_static" in args.impls and b in static_batches:
            ms, compile_s = bench_hf_static(model, b, args.context, args.steps)
            yield _row(shape, b, "hf_static", ms, floor, f"first calls {compile_s:.0f} s")
            torch._dynamo.reset()
        free_memory()
    del model
    free_memory()


def autodeploy_rows(shape: str, cfg, batches: list[int], weights, args,
                    bandwidth: float) -> Iterator[TableRow]:
    """The bare step and the engine's step at every batch, one compile for all of them."""
    model, compile_s = compile_autodeploy(cfg, max(batches), args.context, weights.settings, tuple(args.set))
    print(model.report.pass_table(), flush=True)
    for b in batches:
        floor = streamed_bytes(cfg, b, args.context, weights.bytes_per_weight, weights.head_bytes_per_weight,
                               model.pool.caches[0].element_size()) / bandwidth
        ms = bench_autodeploy(model, b, args.context, args.steps)
        yield _row(shape, b, "autodeploy bare step" + args.label, ms, floor, f"compile {compile_s:.0f} s",
                   weights.name)
        ms, waited = bench_engine(model, b, args.context, args.steps)
        yield _row(shape, b, "autodeploy engine" + args.label, ms, floor, f"host waited {waited:.2f} ms/step",
                   weights.name)
    del model
    free_memory()


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
