"""Golden test (rule of the house 4) on every available paged-attention backend:
full-sequence dense attention == prefill then token-by-token decode == chunked prefill, without and
with the rotary embedding folded into the op (``fuse_rope_attention``), with Llama-4's chunked
attention and with ALiBi (a backend that cannot run a feature is checked to refuse it); and with an FP8
(e4m3) cache: equal to dense attention on keys and values rounded through FP8 as the cache rounds them,
and close to the unquantized cache."""

import pytest
import torch

from autodeploy.errors import ConfigError
from autodeploy.ops.attention_backends import ATTENTION_BACKENDS, resolve_attention_backend
from autodeploy.ops.paged_attention import from_cache, to_cache_dtype
from autodeploy.ops.rope import rope_reference
from paged_batches import random_cache, run_schedule, shuffled_blocks

PAGE, BLOCKS, SCALE = 4, 32, 0.35
LENGTHS = [13, 6, 9]
FP8 = torch.float8_e4m3fn
# per-tensor k/v scales of an FP8 cache: k maps |k| <= 3.5 (randn: nearly all) into e4m3's 448; v small
# enough that the largest values saturate (they must saturate alike everywhere)
FP8_SCALES = (3.5 / 448, 0.004)


def _backends():
    names = []
    for name in ATTENTION_BACKENDS.names():
        try:
            resolve_attention_backend(name, torch.device("cpu"))
            names.append(name)
        except ConfigError:
            continue
    return names


def _dense(q, k, v, window, softcap, sinks, variants):
    return torch.ops.autodeploy.attention(q[None], k[None], v[None], SCALE, True, window, softcap, sinks,
                                          **variants)[0]


def _schedules():
    prompt = [5, 2, 9]  # prefill these, then decode the rest one token per step (sequences staggered)
    decode = [[(s, prompt[s]) for s in range(3)]]
    left = [n - p for n, p in zip(LENGTHS, prompt)]
    for i in range(max(left)):
        decode.append([(s, 1) for s in range(3) if i < left[s]])
    chunked = []
    done = [0, 0, 0]
    while any(d < n for d, n in zip(done, LENGTHS)):
        step = [(s, min(4, LENGTHS[s] - done[s])) for s in range(3) if done[s] < LENGTHS[s]]
        for s, n in step:
            done[s] += n
        chunked.append(step)
    return {"full": [[(s, n) for s, n in enumerate(LENGTHS)]], "prefill+decode": decode, "chunked": chunked}


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_golden(backend, heads, kv_heads, dtype):
    _golden(backend, heads, kv_heads, dtype, window=None, softcap=None, sinks=None)


@pytest.mark.parametrize("backend", _backends())
def test_golden_window_softcap_sinks(backend):
    sinks = torch.randn(4)
    if "sinks" in ATTENTION_BACKENDS.get(backend).unsupported:
        sinks = None
    _golden(backend, 4, 2, torch.float32, window=4, softcap=3.0, sinks=sinks)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_golden_with_rope(backend, heads, kv_heads, dtype):
    _golden(backend, heads, kv_heads, dtype, window=None, softcap=None, sinks=None, rope=(16, False))


@pytest.mark.parametrize("backend", _backends())
def test_golden_with_partial_interleaved_rope_and_window(backend):
    _golden(backend, 4, 2, torch.float32, window=4, softcap=None, sinks=None, rope=(8, True))


def _refused_or_golden(backend, heads, kv_heads, dtype, **features):
    """The golden test of a layer using ``chunk_size``/``alibi_slopes``, or, on a backend that lists
    the feature as unsupported, its refusal at compile time (``check_layer``)."""
    used = {"chunk_size": features.get("chunk"), "alibi_slopes": features.get("alibi")}
    spec = ATTENTION_BACKENDS.get(backend)
    if any(used[f] and f in spec.unsupported for f in used):
        with pytest.raises(ConfigError, match="does not support"):
            spec.check_layer(16, used, "layer0")
        return
    _golden(backend, heads, kv_heads, dtype, window=features.get("window"), softcap=None, sinks=None,
            rope=features.get("rope"), chunk=features.get("chunk"), alibi=features.get("alibi", False))


# MHA, GQA and MQA, each in one dtype (the interpreter is slow: every combination would add minutes)
HEADS_AND_DTYPES = pytest.mark.parametrize("heads,kv_heads,dtype", [
    (4, 4, torch.float32), (4, 2, torch.float16), (4, 1, torch.float32)], ids=["mha-fp32", "gqa-fp16", "mqa-fp32"])


@pytest.mark.parametrize("backend", _backends())
@HEADS_AND_DTYPES
def test_golden_chunked_attention(backend, heads, kv_heads, dtype):
    """Chunks of 3 tokens (Llama-4's chunked attention, with its RoPE folded in): every schedule's steps
    start and end mid-chunk."""
    _refused_or_golden(backend, heads, kv_heads, dtype, chunk=3, rope=(16, False))


@pytest.mark.parametrize("backend", _backends())
@HEADS_AND_DTYPES
def test_golden_alibi(backend, heads, kv_heads, dtype):
    _refused_or_golden(backend, heads, kv_heads, dtype, alibi=True)


@pytest.mark.parametrize("backend", _backends())
def test_golden_alibi_chunk_and_window_together(backend):
    _refused_or_golden(backend, 4, 2, torch.float32, alibi=True, chunk=5, window=3)


def _rotary(rope, dtype):
    """Per-sequence cos/sin of positions 0.. (as a model computes them) and the dense reference's rotation."""
    if rope is None:
        return None, lambda x, s: x
    rot_dim, interleaved = rope
    angles = [torch.arange(n)[:, None] * 0.1 * torch.arange(1, rot_dim + 1)[None, :] for n in LENGTHS]
    cos, sin = [a.cos().to(dtype) for a in angles], [a.sin().to(dtype) for a in angles]

    def rotate(x, s):  # in fp32, rounded once: tolerances cover the torch backend's rotation in fp16
        return rope_reference(x.float(), cos[s].float()[:, None], sin[s].float()[:, None], interleaved).to(dtype)

    return (cos, sin, interleaved), rotate


def _golden(backend, heads, kv_heads, dtype, window, softcap, sinks, rope=None, chunk=None, alibi=False,
            fp8_scales=None):
    """Every schedule == dense attention; ``fp8_scales`` (k_scale, v_scale): an FP8 cache, and the dense
    attention's keys and values rounded through FP8 as the cache rounds them."""
    op = ATTENTION_BACKENDS.get(backend).op
    q, k, v = ([torch.randn(n, h, 16).to(dtype) for n in LENGTHS] for h in (heads, kv_heads, kv_heads))
    rotary, rotate = _rotary(rope, dtype)
    variants = {"chunk_size": chunk, "alibi_slopes": torch.rand(heads) if alibi else None}
    cached = _fp8_round_trip(fp8_scales)
    want = [_dense(rotate(q[s], s).float(), cached(rotate(k[s], s), 0), cached(v[s], 1), window, softcap, sinks,
                   variants) for s in range(len(LENGTHS))]
    blocks = shuffled_blocks(LENGTHS, PAGE, BLOCKS)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    scales = dict(zip(("k_scale", "v_scale"), fp8_scales)) if fp8_scales else {}
    for name, schedule in _schedules().items():
        cache = random_cache(BLOCKS, PAGE, kv_heads, 16, FP8 if fp8_scales else dtype)
        got = run_schedule(op, q, k, v, blocks, schedule, PAGE, cache, SCALE, window, softcap, sinks, rotary,
                           **variants, **scales)
        for s in range(len(LENGTHS)):
            torch.testing.assert_close(got[s].float(), want[s].float(), atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def _fp8_round_trip(fp8_scales):
    """x -> x as an FP8 cache with these scales gives it back (fp32); x -> x in fp32 without one."""
    if fp8_scales is None:
        return lambda x, which: x.float()
    return lambda x, which: from_cache(to_cache_dtype(x, FP8, fp8_scales[which]), torch.float32, fp8_scales[which])


@pytest.mark.parametrize("backend", _backends())
@HEADS_AND_DTYPES
def test_golden_fp8_cache(backend, heads, kv_heads, dtype):
    _golden(backend, heads, kv_heads, dtype, None, None, None, fp8_scales=FP8_SCALES)


def test_golden_fp8_cache_with_rope_window_softcap_sinks():
    """(The Triton kernel with these features and an FP8 cache: test_paged_attention_kernel.py, one step.)"""
    _golden("torch", 4, 2, torch.float32, window=4, softcap=3.0, sinks=torch.randn(4), rope=(16, False),
            fp8_scales=FP8_SCALES)


def test_fp8_cache_is_close_to_the_unquantized_cache():
    """(A property of the format, shown on the reference: every backend equals it with an FP8 cache.)


    With scales calibrated as the producers do (max |x| / 448: nothing saturates), e4m3's 3 mantissa
    bits put each cached value within 2^-4 of itself (half a step; subnormals aside). An output row is a
    convex combination of values: their rounding moves it by at most 2^-4 max|v|. The keys' rounding moves
    each score by at most 2^-4 scale sum|q k| and the weights by that factor's exponential. Checked against
    2^-4 max|v| (0.19-0.26 for these randn q/k/v, head dim 16, scale 0.35); seen 0.10-0.13 over 5 seeds."""
    op = ATTENTION_BACKENDS.get("torch").op
    q, k, v = ([torch.randn(n, h, 16) for n in LENGTHS] for h in (4, 2, 2))
    calibrated = {f"{name}_scale": float(torch.cat(x).abs().max()) / 448 for name, x in (("k", k), ("v", v))}
    blocks, schedule = shuffled_blocks(LENGTHS, PAGE, BLOCKS), _schedules()["prefill+decode"]
    outs = []
    for dtype, scales in ((torch.float32, {}), (FP8, calibrated)):
        cache = random_cache(BLOCKS, PAGE, 2, 16, dtype)
        outs.append(run_schedule(op, q, k, v, blocks, schedule, PAGE, cache, SCALE, **scales))
    bound = 2 ** -4 * float(torch.cat(v).abs().max())
    for plain, fp8 in zip(*outs):
        torch.testing.assert_close(fp8, plain, atol=bound, rtol=0)


def test_every_backend_has_the_reference_schema():
    reference = torch.ops.autodeploy.paged_attention.default._schema
    for name in ATTENTION_BACKENDS.names():
        schema = ATTENTION_BACKENDS.get(name).op._schema
        assert [(a.name, str(a.type)) for a in schema.arguments] == [(a.name, str(a.type)) for a in reference.arguments]
        assert [str(r.type) for r in schema.returns] == [str(r.type) for r in reference.returns]
