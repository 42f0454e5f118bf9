"""Golden test (rule of the house 4) of MLA on every backend with an MLA op: the dense ``mla`` op on whole
sequences == prefill then token-by-token decode == chunked prefill, through the latent paged cache."""

import pytest
import torch

from autodeploy.errors import ConfigError
from autodeploy.ops.attention_backends import triton_runs_on
from autodeploy.ops.mla import MLA_OPS, mla_op_for
from paged_batches import shuffled_blocks, step_metadata
from test_paged_attention_golden import LENGTHS, PAGE, _schedules

BLOCKS, SCALE, HEADS, RANK, ROPE_DIM, NOPE, V = 32, 0.3, 4, 32, 8, 16, 12


def _backends():
    return [name for name in MLA_OPS if name != "triton" or triton_runs_on(torch.device("cpu")) is None]


def _run(op, per_seq, blocks, schedule, cache):
    """Feed per-sequence inputs ([L, ...] each) to the paged op step by step; per-sequence outputs."""
    done, outs = [0] * len(LENGTHS), [None] * len(LENGTHS)
    w_kv_b = per_seq[-1]
    for step in schedule:
        rows = [(s, done[s], done[s] + n) for s, n in step]
        meta = step_metadata([(done[s], n, blocks[s]) for s, n in step], PAGE)
        inputs = [torch.cat([x[s][a:b] for s, a, b in rows]) for x in per_seq[:-1]]
        out = op(*inputs, w_kv_b, cache, *meta, SCALE)
        offset = 0
        for s, a, b in rows:
            part = out[offset: offset + b - a]
            outs[s] = part if outs[s] is None else torch.cat([outs[s], part])
            offset, done[s] = offset + b - a, b
    return outs


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_golden_mla(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    shapes = ((HEADS, NOPE), (HEADS, ROPE_DIM), (RANK,), (ROPE_DIM,))
    per_seq = [[rand(n, *shape) for n in LENGTHS] for shape in shapes]
    w_kv_b = rand(HEADS * (NOPE + V), RANK) * RANK**-0.5
    want = [torch.ops.autodeploy.mla(*(x[s][None] for x in per_seq), w_kv_b, SCALE)[0] for s in range(len(LENGTHS))]
    blocks = shuffled_blocks(LENGTHS, PAGE, BLOCKS)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for name, schedule in _schedules().items():
        cache = torch.randn(BLOCKS, PAGE, RANK + ROPE_DIM, generator=gen).to(dtype)
        got = _run(mla_op_for(backend, "test"), [*per_seq, w_kv_b], blocks, schedule, cache)
        for s in range(len(LENGTHS)):
            torch.testing.assert_close(got[s].float(), want[s].float(), atol=tol, rtol=tol,
                                       msg=lambda m: f"{name}: {m}")


def test_backends_without_an_mla_kernel_are_refused():
    with pytest.raises(ConfigError, match="attention backend 'flashinfer' has no MLA"):
        mla_op_for("flashinfer", "layer0")


def test_an_fp8_kv_cache_is_refused_for_mla_layers_and_a_model_dtype_one_is_not():
    from autodeploy.ops.attention_backends import resolve_attention_backend
    from autodeploy.quantization.kv_cache import kv_cache_format
    from passes.insert_kv_cache import _check_layers

    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.autodeploy.mla.default, tuple(graph.placeholder(f"x{i}") for i in range(6)))
    backend = resolve_attention_backend("torch", torch.device("cpu"))
    _check_layers([node], backend, kv_cache_format("auto", None, torch.float32))
    with pytest.raises(RuntimeError, match="FP8 KV cache is not supported for MLA layers"):
        _check_layers([node], backend, kv_cache_format("fp8", None, torch.float32))
