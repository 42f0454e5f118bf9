"""The number formats in plain torch (``autodeploy.quantization.numerics``): the definitions the ops
and kernels are checked against."""

import pytest
import torch

from autodeploy.quantization import numerics as nm


def test_e2m1_codes_unpack_low_nibble_first_with_sign_bit():
    packed = torch.tensor([[0x21, 0xF9]], dtype=torch.uint8)  # codes 1, 2 | 9, 15
    assert nm.unpack_e2m1(packed).tolist() == [[0.5, 1.0, -0.5, -6.0]]


def test_nvfp4_round_trip_error_is_within_half_a_step_of_each_group():
    weight = torch.randn(32, 64)
    packed, scale, scale_2 = nm.quantize_nvfp4(weight)
    assert packed.shape == (32, 32) and packed.dtype == torch.uint8
    assert scale.shape == (32, 4) and scale.dtype == torch.float8_e4m3fn and scale_2.shape == ()
    back = nm.dequantize_nvfp4(packed, scale, scale_2)
    group_step = (scale.float() * scale_2).repeat_interleave(16, dim=1)  # one unit of e2m1 in each group
    assert ((back - weight).abs() <= group_step + 1e-6).all()  # e2m1 steps are at most 1 unit apart (4 -> 6: 2)


def test_nvfp4_ties_round_to_the_even_code():
    scaled = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, -0.75])
    codes = nm._round_to_e2m1_codes(scaled)
    assert nm._e2m1_table(codes.device)[codes.long()].tolist() == [0.0, 1.0, 1.0, 2.0, 4.0, -1.0]


def test_nvfp4_per_row_global_scale_scales_each_row():
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(4, 16))
    per_row = torch.tensor([1.0, 2.0, 3.0, 4.0]) * scale_2
    torch.testing.assert_close(nm.dequantize_nvfp4(packed, scale, per_row),
                               nm.dequantize_nvfp4(packed, scale, scale_2) * torch.arange(1.0, 5.0)[:, None])


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_weight_round_trip(kind):
    weight = torch.randn(48, 64)
    if kind == "block":
        q, scale = nm.quantize_fp8_blocks(weight, (32, 32))
        assert scale.shape == (2, 2)  # 48 rows: a partial second row block
        back = nm.dequantize_fp8(q, scale, (32, 32))
    else:
        q, scale = nm.quantize_fp8_per_channel(weight) if kind == "channel" else nm.quantize_fp8_per_tensor(weight)
        back = nm.dequantize_fp8(q, scale)
    assert q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(back, weight, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


def test_block_scale_needs_its_block_size():
    with pytest.raises(ValueError, match="block size"):
        nm.dequantize_fp8(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1))


def test_activation_fake_quantization_modes():
    x = torch.randn(3, 64) * torch.tensor([[1.0], [100.0], [0.01]])
    assert torch.equal(nm.fake_quantize_activations(x, "none"), x)
    token = nm.fake_quantize_activations(x, "token")
    torch.testing.assert_close(token, x, rtol=0.07, atol=0)  # each row at its own scale: relative error
    assert token.abs().amax(dim=1).tolist() == pytest.approx(x.abs().amax(dim=1).tolist())  # max maps to 448 exactly
    group = nm.fake_quantize_activations(x, "group", group=32)
    torch.testing.assert_close(group, x, rtol=0.07, atol=0)
    scale = torch.tensor(0.01)  # static: values past 448 * scale saturate
    assert nm.fake_quantize_activations(x, "static", scale).abs().max() == pytest.approx(4.48)
    assert torch.equal(nm.fake_quantize_activations(torch.zeros(2, 8), "token"), torch.zeros(2, 8))


def test_activation_fake_quantization_refuses_bad_requests():
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="input_scale"):
        nm.fake_quantize_activations(x, "static")
    with pytest.raises(ValueError, match="groups of 32"):
        nm.fake_quantize_activations(x, "group", group=32)
    with pytest.raises(ValueError, match="unknown activation"):
        nm.fake_quantize_activations(x, "tensor")
