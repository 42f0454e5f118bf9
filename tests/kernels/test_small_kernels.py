"""RMSNorm (+ residual add), gated activation, RoPE and KV-cache write kernels against their reference ops
(interpreter)."""

import pytest
import torch

from autodeploy.kernels.activation import act_mul
from autodeploy.kernels.norm import add_rms_norm, rms_norm
from autodeploy.kernels.rope import rope, rope_qk

DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden):
    x, w = torch.randn(3, 5, hidden).to(dtype), torch.randn(hidden).to(dtype)
    got = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, torch.ops.autodeploy.rms_norm(x, w, 1e-5), **_tol(dtype))
    strided = torch.randn(7, 2 * hidden).to(dtype)[:, ::2]  # non-unit column stride
    torch.testing.assert_close(rms_norm(strided, w, 1e-6), torch.ops.autodeploy.rms_norm(strided, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_norm_and_the_sum(dtype):
    x, residual, w = torch.randn(6, 80).to(dtype), torch.randn(6, 80).to(dtype), torch.randn(80)
    normed, summed = add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_summed = torch.ops.autodeploy.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(summed, want_summed, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, **_tol(dtype))
    assert add_rms_norm(x[:0], residual[:0], w, 1e-6)[0].shape == (0, 80)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_act_mul_on_halves_of_a_fused_gemm_output(dtype, activation):
    fused = torch.randn(2, 3, 2 * 1100).to(dtype)  # more columns than one block
    gate, up = fused.chunk(2, dim=-1)
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[activation]
    want = (act(gate.float()) * up.float()).to(dtype)
    torch.testing.assert_close(act_mul(gate, up, activation), want, **_tol(dtype))


def test_swiglu_ops_agree_with_each_other():
    x, w_gate, w_up, w_down = torch.randn(4, 16), torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    separate = torch.ops.autodeploy.swiglu(x, w_gate, w_up, w_down, "silu")
    gate_up = torch.nn.functional.linear(x, torch.cat([w_gate, w_up]))
    torch.testing.assert_close(torch.ops.autodeploy.swiglu_down(gate_up, w_down, "silu"), separate)


def _rope_case(rot, bnsd):
    """q as HF computes it: [B, S, H, D] projected then transposed to [B, H, S, D]; cos [B, 1, S, R]."""
    b, s, h, d = 2, 5, 3, 16
    x = torch.randn(b, s, h, d)
    x = x.transpose(1, 2) if bnsd else x
    cos, sin = torch.randn(b, s, rot), torch.randn(b, s, rot)
    cos, sin = ((t[:, None] if bnsd else t[:, :, None]) for t in (cos, sin))
    return x, cos, sin


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 8])
@pytest.mark.parametrize("bnsd", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(interleaved, rot, bnsd, dtype):
    x, cos, sin = (t.to(dtype) for t in _rope_case(rot, bnsd))
    got = rope(x, cos, sin, interleaved)
    assert got.is_contiguous()
    torch.testing.assert_close(got, torch.ops.autodeploy.rope(x, cos, sin, interleaved), **_tol(dtype))


def test_rope_on_flat_tokens():
    x, cos, sin = torch.randn(7, 4, 32), torch.randn(7, 1, 32), torch.randn(7, 1, 32)
    torch.testing.assert_close(rope(x, cos, sin), torch.ops.autodeploy.rope(x, cos, sin, False))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_rotates_both_in_one_launch(interleaved, dtype):
    """GQA: q has more heads than k; both are strided views of one fused qkv output."""
    qkv = torch.randn(1, 5, (4 + 2 * 2) * 16).to(dtype)
    q = qkv[..., :64].view(1, 5, 4, 16).transpose(1, 2)
    k = qkv[..., 64:96].view(1, 5, 2, 16).transpose(1, 2)
    cos, sin = (torch.randn(1, 1, 5, 16).to(dtype) for _ in range(2))
    got_q, got_k = rope_qk(q, k, cos, sin, interleaved)
    want_q, want_k = torch.ops.autodeploy.rope_qk(q, k, cos, sin, interleaved)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(got_k, want_k, **_tol(dtype))
    torch.testing.assert_close(want_k, torch.ops.autodeploy.rope(k, cos, sin, interleaved))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_kv_cache_write_as_the_reference_writes_and_padding_rows_zeroed(cache_dtype):
    """FlashInfer's cache write: bytes equal to the reference op's (an FP8 pool quantized with its scales,
    saturating), slot -1 skipped, output rows of tokens past cu_seqlens[-1] zeroed."""
    from autodeploy.kernels.kv_cache_write import write_kv_cache
    from autodeploy.ops.paged_attention import write_kv_cache as reference_write

    k, v = torch.randn(5, 2, 16) * 3, torch.randn(5, 2, 16)
    slots, cu_seqlens = torch.tensor([7, -1, 2, 12, -1]), torch.tensor([0, 2, 4])
    got, want = (torch.randn(4, 2, 4, 2, 16).to(cache_dtype) for _ in range(2))
    want.copy_(got)
    out = torch.randn(5, 4, 16)
    write_kv_cache(k, v, got, slots, out, cu_seqlens, k_scale=0.01, v_scale=0.5)
    reference_write(k, v, want, slots, k_scale=0.01, v_scale=0.5)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert out[4].abs().max() == 0 and out[:4].abs().min() > 0
