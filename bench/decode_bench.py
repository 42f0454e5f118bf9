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
    # a ~2.3B Mamba-2 hybrid in Bamba's layout (attention every 6th layer): the state ops' decode graphs
    "bamba2b": dict(model_type="bamba", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=8, attn_layer_indices=[5, 11, 17, 23],
                    mamba_n_heads=64, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, vocab_size=128256,
                    tie_word_embeddings=False),
}


def llama_config(shape: str):
    """The HF config of a shape: a Llama unless the shape names its ``model_type``."""
    from transformers import AutoConfig, LlamaConfig

    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type", None)
    if model_type is not None:
        return AutoConfig.for_model(model_type, **fields, dtype="bfloat16")
    return LlamaConfig(**fields, dtype="bfloat16")


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
    if hasattr(cfg, "mamba_d_state"):
        return hybrid_streamed_bytes(cfg, batch, context, bytes_per_weight, head_bytes, kv_bytes)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k+v, o, gate+up+down
    weights = bytes_per_weight * layers * per_layer + head_bytes * cfg.vocab_size * h
    kv_cache = kv_bytes * layers * batch * context * 2 * kv
    return weights + kv_cache


def hybrid_streamed_bytes(cfg, batch: int, context: int, bytes_per_weight: float, head_bytes: float,
                          kv_bytes: int) -> float:
    """A Mamba-2 hybrid's decode step: every weight but the embedding's (counted on the meta device), the
    attention layers' KV cache, and each Mamba layer's state read and written (SSM fp32, conv bf16)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = dict(AutoModelForCausalLM.from_config(cfg).named_parameters())
    weights = sum(p.numel() for name, p in params.items() if "embed_tokens" not in name and "lm_head" not in name)
    attention = len(cfg.attn_layer_indices)
    kv = kv_bytes * attention * batch * context * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    conv_channels = cfg.mamba_expand * cfg.hidden_size + 2 * cfg.mamba_n_groups * cfg.mamba_d_state
    per_layer = 4 * cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state + 2 * conv_channels * (cfg.mamba_d_conv - 1)
    state = 2 * (cfg.num_hidden_layers - attention) * batch * per_layer
    return bytes_per_weight * weights + head_bytes * cfg.vocab_size * cfg.hidden_size + kv + state


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
    for state in model.pool.state.states if model.pool.state is not None else ():
        state.normal_(generator=gen)
    ids = torch.randint(0, model.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(seed)).tolist()
    return [SequenceChunk(tuple(ids[b]), context, **_placed(model, b, context)) for b in range(batch)]


def _placed(model, b: int, context: int) -> dict:
    """Sequence ``b``'s KV blocks (room for ``context`` tokens and some) and state slot (a model with state)."""
    per_seq = -(-(context + 32) // model.block_size)
    return {"block_ids": tuple(range(b * per_seq + 1, (b + 1) * per_seq + 1)),
            "state_slot": b if model.num_state_slots else -1}


@torch.inference_mode()
def bench_autodeploy(model, batch: int, context: int, steps: int) -> float:
    chunks = decode_chunks(model, batch, context)

    def step():
        model(chunks).argmax(-1).tolist()

    return timed_steps(step, steps)


@torch.inference_mode()
def bench_autodeploy_prefill(model, batch: int, length: int, steps: int) -> float:
    """One step prefilling ``batch`` random prompts of ``length`` tokens, in ms."""
    from autodeploy.kvcache.metadata import SequenceChunk

    ids = torch.randint(0, model.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1)).tolist()
    chunks = [SequenceChunk(tuple(ids[b]), 0, **_placed(model, b, length)) for b in range(batch)]
    return timed_steps(lambda: model(chunks).argmax(-1).tolist(), steps)


@torch.inference_mode()
def bench_hf_prefill(model, batch: int, length: int, steps: int, static: bool) -> float:
    """HF's forward over ``batch`` prompts of ``length`` tokens (with ``static``: into a StaticCache, the
    forward ``torch.compile``d, its compile in the warm-up), in ms."""
    from transformers import StaticCache

    ids = torch.randint(0, model.config.vocab_size, (batch, length), device="cuda")
    kwargs = dict(use_cache=True, logits_to_keep=1)
    forward = model.forward
    if static:
        kwargs |= dict(past_key_values=StaticCache(config=model.config, max_cache_len=length),
                       cache_position=torch.arange(length, device="cuda"))
        forward = torch.compile(model.forward, fullgraph=True)
    return timed_steps(lambda: forward(ids, **kwargs).logits[:, -1].argmax(-1).tolist(), steps)


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
    group.add_argument("--prefill-batch", type=int, default=0,
                       help="also time one prefill of this many prompts of --context tokens (0: no prefill rows)")


def table_rows(args, header) -> Iterator[TableRow]:
    for shape in args.shapes.split(","):
        cfg = llama_config(shape)
        batches = [int(b) for b in args.batches.split(",")]
        if {"hf_eager", "hf_static"} & set(args.impls):
            yield from hf_rows(shape, cfg, batches, args, header.bandwidth)
        if "autodeploy" in args.impls:
            for weights in args.weights:
                yield from autodeploy_rows(shape, cfg, batches, weights, args, header.bandwidth)


def _row(shape: str, batch: int, impl: str, ms: float | None, floor_s: float | None, note: str = "",
         weights: str = "bf16", workload: str = "batch {batch}", tokens: int | None = None):
    """A timed row (``ms`` None: the peer could not run, ``note`` says why); ``tokens`` per step (default batch)."""
    rate = (tokens or batch) * 1e3 / ms if ms else None
    return TableRow("decode", f"{shape} " + workload.format(batch=batch), impl, ms / 1e3 if ms else None, rate,
                    floor_s, note, weights)


def _prefill_row(shape: str, impl: str, args, bench) -> TableRow:
    """The prefill row of ``impl``: ``bench(batch, length, steps)`` ms, or why it could not run."""
    batch, length = args.prefill_batch, args.context
    try:
        ms, note = bench(batch, length, args.steps), ""
    except Exception as exc:  # a peer that cannot run this model (HF's hybrid cache under compile): say so
        ms, note = None, f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    return _row(shape, batch, impl, ms, None, note, workload=f"prefill {{batch}} x {length}", tokens=batch * length)


def hf_rows(shape: str, cfg, batches: list[int], args, bandwidth: float) -> Iterator[TableRow]:
    """HF eager at every batch, HF static cache + compile at ``--static-batches``; each row when measured."""
    static_batches = {int(b) for b in args.static_batches.split(",") if b}
    model = hf_model(cfg)
    for b in batches:
        floor = streamed_bytes(cfg, b, args.context) / bandwidth
        if "hf_eager" in args.impls:
            yield _row(shape, b, "hf_eager", bench_hf_eager(model, b, args.context, args.steps), floor)
        if "hf_static" in args.impls and b in static_batches:
            try:
                ms, compile_s = bench_hf_static(model, b, args.context, args.steps)
                yield _row(shape, b, "hf_static", ms, floor, f"first calls {compile_s:.0f} s")
            except Exception as exc:  # a hybrid's cache may not compile: the table says so
                yield _row(shape, b, "hf_static", None, floor, f"failed: {type(exc).__name__}: {str(exc)[:160]}")
            torch._dynamo.reset()
        free_memory()
    for impl in ("hf_eager", "hf_static") if args.prefill_batch else ():
        if impl in args.impls:
            yield _prefill_row(shape, impl, args, lambda *a: bench_hf_prefill(model, *a, static=impl == "hf_static"))
            torch._dynamo.reset()
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
    if args.prefill_batch:
        yield _prefill_row(shape, "autodeploy" + args.label, args, lambda *a: bench_autodeploy_prefill(model, *a))
    del model
    free_memory()


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
