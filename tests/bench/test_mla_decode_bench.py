"""bench/mla_decode_gpu.py imports without a GPU, and its check (the Triton MLA op against the expanded
reference, cache written bit for bit, padding rows zero) and its kernel-alone call agree with the op on a
small step (interpreter, fp32)."""

import math

import torch

import mla_decode_gpu as bench

SMALL = dict(heads=4, rank=32, rope=8, nope=16, v=12, dtype=torch.float32, device=torch.device("cpu"))


def test_the_benchmarks_check_passes_on_a_small_mixed_step():
    step = bench.latent_step([(5, 3), (0, 4), (9, 1), (0, 0)], pad_tokens=2, **SMALL)
    assert bench.check(step, pad_tokens=2) < 1e-5


def test_the_check_fails_an_op_that_writes_no_cache():
    wrong = bench.latent_step([(5, 1), (9, 1)], **SMALL)
    wrong.op = lambda cache=None: torch.zeros(2, 4, 12)
    assert bench.check(wrong) == math.inf


def test_the_kernel_alone_gives_the_ops_latent_sums():
    step = bench.latent_step([(7, 1), (3, 1)], **SMALL)
    out_lat = step.kernel_call()()
    _, w_uv = bench.split_kv_b(step.w_kv_b, 4, 16)
    got = torch.einsum("thr,hvr->thv", out_lat, w_uv)
    torch.testing.assert_close(got, step.reference(step.cache.clone()), atol=1e-5, rtol=1e-5)
