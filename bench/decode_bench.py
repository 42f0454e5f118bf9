"""The decode section: one decode step (one new token per sequence at ``--context`` cached tokens, the sampled
ids read back to the host as an engine step does) of HF eager, HF static cache + ``torch.compile``, the bare
compiled autodeploy step and the engine's step in steady state (the number that counts), against the bytes the
step must stream (every linear weight, the KV cache, a hybrid's state) at the copy bandwidth. ``--prefill-batch``
adds one prefill step of each. Also what the other sections share: the model shapes, the device's rates,
compiling autodeploy with random weights, the HF model.
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
    from transformers import AutoConfig

    fields = dict(SHAPES[shape])
    return AutoConfig.for_model(fields.pop("model_type", "llama"), **fields, dtype="bfloat16")


def _rate(op, work: float, repeats: int = 20) -> float:
    """``work`` per second of ``op``, timed by CUDA events over ``repeats`` calls after 3 warm-up calls."""
    for _ in range(3):
        op()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        op()
    end.record()
    torch.cuda.synchronize()
    return work * repeats / (start.elapsed_time(end) / 1e3)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), like the anchors."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _rate(lambda: dst.copy_(src), 2 * src.numel())


def gemm_rate(size: int = 8192) -> float:
    """bf16 FLOP/s of a ``size``-cube matmul (the anchors' 767 TFLOP/s on the H200)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    return _rate(lambda: a @ b, 2 * size**3)


def streamed_bytes(cfg, batch: int, context: int, bytes_per_weight: float = 2, head_bytes: float = 2,
                   kv_bytes: int = 2) -> float:
    """Bytes one decode step must read: every linear weight (the LM head at ``head_bytes`` a weight) and the
    KV cache (``kv_bytes`` an element: 2 for bf16, 1 for FP8)."""
    if hasattr(cfg, "mamba_d_state"):
        return hybrid_streamed_bytes(cfg, batch, context, bytes_per_weight, head_bytes, kv_bytes)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k+v, o, gate+up+down
    kv_cache = kv_bytes * layers * batch * context * 2 * kv
    return bytes_per_weight * layers * per_layer + head_bytes * cfg.vocab_size * h + kv_cache


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
    """Milliseconds per call of ``step`` (wall time, the device synchronized at both ends)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def hf_model(cfg, attn_implementation: str | None = None):
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    return model.eval()


@torch.inference_mode()
def bench_hf(model, batch: int, context: int, steps: int, static: bool) -> tuple[float, float]:
    """(ms per decode step, seconds of the first two steps: ``static``'s compile) after a prefill of ``context``
    random tokens; ``static``: a StaticCache and the forward ``torch.compile``d (reduce-overhead)."""
    from transformers import StaticCache

    forward, kwargs = model.forward, {}
    if static:
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        kwargs = dict(past_key_values=StaticCache(config=model.config, max_cache_len=context + steps + 16),
                      cache_position=torch.arange(context, device="cuda"))
    out = model(torch.randint(0, model.config.vocab_size, (batch, context), device="cuda"), use_cache=True,
                logits_to_keep=1, **kwargs)
    cache, state = out.past_key_values, {"next": out.logits[:, -1].argmax(-1), "pos": context}

    def step():
        position = {"cache_position": torch.tensor([state["pos"]], device="cuda")} if static else {}
        out = forward(state["next"][:, None], past_key_values=cache, use_cache=True, **position)
        state["next"] = out.logits[:, -1].argmax(-1)
        state["next"].tolist()
        state["pos"] = min(state["pos"] + 1, context + steps + 8)

    start = time.perf_counter()
    step()
    step()
    return timed_steps(step, steps), time.perf_counter() - start


@torch.inference_mode()
def bench_hf_prefill(model, batch: int, length: int, steps: int, static: bool) -> float:
    """ms of HF's forward over ``batch`` prompts of ``length`` tokens (``static``: into a StaticCache, the forward
    ``torch.compile``d, its compile in the warm-up)."""
    from transformers import StaticCache

    ids = torch.randint(0, model.config.vocab_size, (batch, length), device="cuda")
    kwargs, forward = dict(use_cache=True, logits_to_keep=1), model.forward
    if static:
        kwargs |= dict(past_key_values=StaticCache(config=model.config, max_cache_len=length),
                       cache_position=torch.arange(length, device="cuda"))
        forward = torch.compile(model.forward, fullgraph=True)
    return timed_steps(lambda: forward(ids, **kwargs).logits[:, -1].argmax(-1).tolist(), steps)


def compile_autodeploy(cfg, max_batch: int, context: int, settings: dict | None = None, overrides=(), **fields):
    """(model, compile seconds): random weights on CUDA, a pool for ``max_batch`` sequences of ``context`` tokens
    and some room; ``settings`` and ``fields`` are CompileConfig fields (a weight format's), ``overrides``
    dotted ``key=value`` strings (``--set``)."""
    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig, parse_set_option, set_dotted

    max_seq_len = context + 64  # the engine rows' first prompts decode while later ones prefill
    fields = dict(weights="random", dtype="bfloat16", device="cuda", max_batch_size=max_batch, max_seq_len=max_seq_len,
                  num_kv_blocks=max_batch * -(-max_seq_len // 16) + 1, tokens_per_block=16) | fields | (settings or {})
    for item in overrides:  # passes.fuse_norm_linear.enabled=false
        set_dotted(fields, *parse_set_option(item))
    start = time.perf_counter()
    model = compile_config(cfg, CompileConfig(**{k: v for k, v in fields.items() if v is not None}))
    return model, time.perf_counter() - start


def sequence_chunks(model, ids: list[list[int]], contexts: int | list[int]) -> list:
    """Sequence ``b``: ``ids[b]`` at ``contexts[b]`` cached tokens (one number: all of them), on KV blocks of its
    own (and a state slot)."""
    from autodeploy.kvcache.metadata import SequenceChunk

    contexts = [contexts] * len(ids) if isinstance(contexts, int) else contexts
    per_seq = -(-(max(c + len(row) for c, row in zip(contexts, ids)) + 31) // model.block_size)
    return [SequenceChunk(tuple(row), c, tuple(range(b * per_seq + 1, (b + 1) * per_seq + 1)),
                          state_slot=b if model.num_state_slots else -1)
            for b, (row, c) in enumerate(zip(ids, contexts))]


@torch.inference_mode()
def decode_chunks(model, batch: int, context: int, seed: int = 0) -> list:
    """A decode step of ``batch`` sequences with ``context`` cached tokens each, over a KV pool of random values
    and random token ids: a pool of zeros and identical rows draw less power and run faster than real data
    (METHOD.md), which flattered earlier bare-step numbers."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for cache in model.pool.caches:
        if cache.dtype == torch.float8_e4m3fn:  # (no random kernels for FP8: values of scale 1.0 cast to e4m3)
            cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device, dtype=torch.bfloat16))
        else:
            cache.normal_(generator=gen)
    for state in model.pool.state.states if model.pool.state is not None else ():
        state.normal_(generator=gen)
    return sequence_chunks(model, _random_ids(model, batch, 1, seed), context)


def _random_ids(model, batch: int, length: int, seed: int) -> list[list[int]]:
    return torch.randint(0, model.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def bench_autodeploy(model, batch: int, context: int, steps: int) -> float:
    chunks = decode_chunks(model, batch, context)
    return timed_steps(lambda: model(chunks).argmax(-1).tolist(), steps)


@torch.inference_mode()
def bench_autodeploy_prefill(model, batch: int, length: int, steps: int) -> float:
    """ms of one step prefilling ``batch`` random prompts of ``length`` tokens."""
    chunks = sequence_chunks(model, _random_ids(model, batch, length, seed=1), 0)
    return timed_steps(lambda: model(chunks).argmax(-1).tolist(), steps)


def bench_engine(model, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(ms per engine decode step, ms per step the host spent waiting for the device)."""
    from autodeploy.serve.bench import engine_decode_step_ms

    timing = engine_decode_step_ms(model, batch, context - 4, steps)  # prompt + a few tokens ~ context
    return timing.ms, timing.waited_ms


def add_options(group) -> None:
    group.add_argument("--shapes", default="llama8b,smollm2", help=f"model shapes: some of {', '.join(SHAPES)}")
    group.add_argument("--batches", default="1,8,64,256", help="batch sizes")
    group.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    group.add_argument("--steps", type=int, default=20, help="timed steps")
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="compile setting of the autodeploy rows and the serving section's server (dotted key), "
                            "e.g. kv_cache_dtype=fp8")
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


def _failed(exc: Exception) -> str:
    return f"failed: {type(exc).__name__}: {str(exc)[:160]}"


def _prefill_row(shape: str, impl: str, args, bench) -> TableRow:
    """The prefill row of ``impl``: ``bench(batch, length, steps)`` ms, or why it could not run."""
    batch, length = args.prefill_batch, args.context
    try:
        ms, note = bench(batch, length, args.steps), ""
    except Exception as exc:  # a peer that cannot run this model (HF's hybrid cache under compile): say so
        ms, note = None, _failed(exc)
    return _row(shape, batch, impl, ms, None, note, workload=f"prefill {{batch}} x {length}", tokens=batch * length)


def hf_rows(shape: str, cfg, batches: list[int], args, bandwidth: float) -> Iterator[TableRow]:
    """HF eager and HF static cache + compile at every batch (then their prefill rows); each row when measured."""
    model = hf_model(cfg)
    peers = [impl for impl in ("hf_eager", "hf_static") if impl in args.impls]
    for b in batches:
        floor = streamed_bytes(cfg, b, args.context) / bandwidth
        for impl in peers:
            try:
                ms, first_s = bench_hf(model, b, args.context, args.steps, static=impl == "hf_static")
                yield _row(shape, b, impl, ms, floor, f"first calls {first_s:.0f} s" if impl == "hf_static" else "")
            except Exception as exc:  # a hybrid's cache may not compile: the table says so
                yield _row(shape, b, impl, None, floor, _failed(exc))
            torch._dynamo.reset()
        free_memory()
    for impl in peers if args.prefill_batch else ():
        yield _prefill_row(shape, impl, args, lambda *a: bench_hf_prefill(model, *a, static=impl == "hf_static"))
        torch._dynamo.reset()
    del model
    free_memory()


def autodeploy_rows(shape: str, cfg, batches: list[int], weights, args, bandwidth: float) -> Iterator[TableRow]:
    """The bare step and the engine's step at every batch, one compile for all of them."""
    model, compile_s = compile_autodeploy(cfg, max(batches), args.context, weights.settings, tuple(args.set))
    print(model.report.pass_table(), flush=True)
    for b in batches:
        floor = streamed_bytes(cfg, b, args.context, weights.bytes_per_weight, weights.head_bytes_per_weight,
                               model.pool.caches[0].element_size()) / bandwidth
        ms = bench_autodeploy(model, b, args.context, args.steps)
        yield _row(shape, b, "autodeploy bare step", ms, floor, f"compile {compile_s:.0f} s", weights.name)
        ms, waited = bench_engine(model, b, args.context, args.steps)
        yield _row(shape, b, "autodeploy engine", ms, floor, f"host waited {waited:.2f} ms/step", weights.name)
    if args.prefill_batch:
        yield _prefill_row(shape, "autodeploy", args, lambda *a: bench_autodeploy_prefill(model, *a))
    del model
    free_memory()
