"""Stacking quantized linears (fused q/k/v, gate/up): where each part's tensors land."""

import pytest
import torch
from torch import fx

from autodeploy.export import get_tensor_attr
from autodeploy.quantization.graph import add_quant_params, can_stack, redirect_stacked, stack_quant_linears
from autodeploy.quantization.params import ParameterWriter, QuantLinear
from autodeploy.quantization.scheme import LinearFormat

STATIC = LinearFormat("fp8", "tensor", "static", input_scale_name="input_scale")


def _stack(fmt, rows, k=32):
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    writer = ParameterWriter(gm, torch.device("cpu"))
    parts = [QuantLinear(f"attn.{name}", fmt, n, k) for name, n in zip("qkv", rows)]
    for part in parts:
        add_quant_params(gm, writer, part)
    fused = stack_quant_linears(gm, parts)
    redirect_stacked(writer, fused, parts)
    return gm, writer, parts, fused


def test_per_tensor_scales_become_rows_of_a_channel_vector_and_input_scales_their_max():
    gm, writer, parts, fused = _stack(STATIC, (4, 2, 2))
    assert fused.module == "attn.fused_q_k_v" and fused.fmt.weight_scale == "channel"
    for i, part in enumerate(parts):
        writer.write(part.name("weight"), torch.full((part.out_features, 32), float(i + 1)).to(torch.float8_e4m3fn))
        writer.write(part.name("scale"), torch.tensor(0.1 * (i + 1)))
        writer.write(part.name("input_scale"), torch.tensor([0.5, 2.0, 1.0][i]))
    assert all(writer.complete(fused.name(role)) for role in fused.roles())
    weight = get_tensor_attr(gm, fused.name("weight")).float()
    assert weight[:, 0].tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    torch.testing.assert_close(get_tensor_attr(gm, fused.name("scale")),
                               torch.tensor([0.1] * 4 + [0.2] * 2 + [0.3] * 2))
    assert get_tensor_attr(gm, fused.name("input_scale")).item() == 2.0


def test_block_scales_stack_by_row_blocks_and_nvfp4_global_scales_per_row():
    block = LinearFormat("fp8", "block", "group", block_size=(2, 16))
    gm, writer, parts, fused = _stack(block, (4, 2))
    assert fused.spec("scale")[0] == (3, 2)
    writer.write(parts[1].name("scale"), torch.full((1, 2), 7.0))
    assert get_tensor_attr(gm, fused.name("scale"))[2].tolist() == [7.0, 7.0]
    assert not can_stack([QuantLinear("a", block, 3, 32), QuantLinear("b", block, 4, 32)])  # 3 rows: half a block
    gm, writer, parts, fused = _stack(LinearFormat("nvfp4", "nvfp4", "none"), (4, 2))
    assert fused.spec("scale_2")[0] == (6,)
    writer.write(parts[0].name("scale_2"), torch.tensor(3.0))
    assert get_tensor_attr(gm, fused.name("scale_2"))[:4].tolist() == [3.0] * 4
    assert not writer.complete(fused.name("scale_2"))  # the second part has not arrived


def test_a_tensor_of_the_wrong_shape_is_refused():
    _, writer, parts, _ = _stack(STATIC, (4, 2, 2))
    with pytest.raises(Exception, match=r"attn.q.weight: checkpoint shape \(4, 16\) != expected \(4, 32\)"):
        writer.write(parts[0].name("weight"), torch.zeros(4, 16, dtype=torch.float8_e4m3fn))
