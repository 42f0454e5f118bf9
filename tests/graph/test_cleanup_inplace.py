"""cleanup_graph turns in-place arithmetic nobody else observes into its out-of-place op, and drops
detaches (and the constant copies only they kept alive)."""

import torch

from autodeploy.testing import export_for_test

aten = torch.ops.aten


def _targets(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def _check(module, *inputs):
    gm = export_for_test(module, inputs)
    torch.testing.assert_close(gm(*inputs), module(*inputs))
    return _targets(gm)


class PrivateDivide(torch.nn.Module):
    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        scores /= 4.0  # Falcon's spelling of the attention scale
        return scores.softmax(-1)


class ReadBeforeMutation(torch.nn.Module):
    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        doubled = scores * 2.0  # reads the value before it is divided in place
        scores /= 4.0
        return scores + doubled


class MutatesThroughAView(torch.nn.Module):
    def forward(self, q, k):
        scores = q @ k.transpose(-1, -2)
        flat = scores.view(-1)
        flat.mul_(3.0)  # changes `scores` too
        return scores + flat.sum()


def test_private_inplace_divide_becomes_divide():
    targets = _check(PrivateDivide(), torch.randn(3, 4), torch.randn(5, 4))
    assert aten.div.Tensor in targets and aten.div_.Tensor not in targets


def test_inplace_on_a_value_read_elsewhere_is_kept():
    targets = _check(ReadBeforeMutation(), torch.randn(3, 4), torch.randn(5, 4))
    assert aten.div_.Tensor in targets


def test_inplace_through_a_view_is_kept():
    targets = _check(MutatesThroughAView(), torch.randn(3, 4), torch.randn(5, 4))
    assert aten.mul_.Tensor in targets


class TensorConstantInForward(torch.nn.Module):
    """``torch.tensor`` in forward exports as lift_fresh_copy (+ detach_ when detached in place)."""

    def forward(self, x):
        unused = torch.tensor([0.5, 2.0])
        unused.detach_()
        scale = torch.tensor(3.0).detach()
        return x * scale


def test_detaches_and_the_constant_copies_they_kept_are_dropped():
    x = torch.randn(3, 4)
    gm = export_for_test(TensorConstantInForward(), (x,))
    torch.testing.assert_close(gm(x), TensorConstantInForward()(x))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [aten.lift_fresh_copy.default, aten.mul.Tensor]  # the unused constant's copy is gone
