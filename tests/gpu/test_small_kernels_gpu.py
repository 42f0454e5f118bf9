"""The small fused kernels at the 8B shape on CUDA, in bf16, against their torch references."""

import pytest
import torch
from cuda_only import BF16_TOL, ON_CUDA
from gpu_harness import rel_err
from kernel_bench import HIDDEN, HKV, HQ, INTER, D

from autodeploy.kernels.activation import act_mul
from autodeploy.kernels.argmax import argmax_rows
from autodeploy.kernels.norm import add_rms_norm, rms_norm
from autodeploy.kernels.rope import rope, rope_qk
from autodeploy.ops.mlp import ACTIVATIONS
from autodeploy.ops.norm import rms_norm_reference
from autodeploy.ops.rope import rope_reference

pytestmark = ON_CUDA
TOKENS = (1, 256, 8192)


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_and_add_rms_norm(tokens):
    x, res, w = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)) < BF16_TOL
    normed, summed = add_rms_norm(x, res, w, 1e-5)
    assert rel_err(summed, x + res) < BF16_TOL
    assert rel_err(normed, rms_norm_reference(x + res, w, 1e-5)) < BF16_TOL


@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(tokens):
    gate, up = randn(tokens, 2 * INTER).chunk(2, dim=-1)
    assert rel_err(act_mul(gate, up), ACTIVATIONS["silu"](gate) * up) < BF16_TOL


@pytest.mark.parametrize("rows", (1, 64, 256))
def test_argmax_over_the_8b_vocabulary(rows):
    logits = randn(rows, 128256)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("tokens", TOKENS)
def test_rope_on_q_and_on_q_and_k_of_the_fused_qkv(tokens):
    qkv = randn(1, tokens, (HQ + 2 * HKV) * D)  # q and k as the fused-qkv graph makes them: strided views
    q = qkv[..., : HQ * D].view(1, tokens, HQ, D).transpose(1, 2)
    k = qkv[..., HQ * D: (HQ + HKV) * D].view(1, tokens, HKV, D).transpose(1, 2)
    cos, sin = randn(1, 1, tokens, D), randn(1, 1, tokens, D)
    want_q, want_k = rope_reference(q, cos, sin, False), rope_reference(k, cos, sin, False)
    assert rel_err(rope(q, cos, sin), want_q) < BF16_TOL
    got_q, got_k = rope_qk(q, k, cos, sin)
    assert max(rel_err(got_q, want_q), rel_err(got_k, want_k)) < BF16_TOL
