"""cleanup_graph folds a tensor filled slice by slice (HF MLA's keys) into ``cat``, and leaves every fill
it cannot prove equal alone."""

import torch

from autodeploy.testing import export_for_test

aten = torch.ops.aten


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _check(module, *inputs):
    gm = export_for_test(module, inputs, {0: 2, 1: 2})
    second = tuple(torch.randn(*x.shape[:2], 9, *x.shape[3:]) for x in inputs)
    for args in (inputs, second):
        torch.testing.assert_close(gm(*args), module(*args))
    return _targets(gm)


class MLAKeys(torch.nn.Module):
    """DeepSeek's expand_kv: k_nope per head, the rotary key broadcast from one head, cast on copy."""

    def forward(self, k_nope, k_rot):
        keys = k_nope.new_empty(*k_nope.shape[:-1], 24)
        keys[..., :16].copy_(k_nope)
        keys[..., 16:].copy_(k_rot.expand(-1, k_nope.shape[1], -1, -1).double())
        return keys * 2


def test_mla_key_fill_becomes_cat():
    targets = _check(MLAKeys(), torch.randn(1, 4, 5, 16), torch.randn(1, 1, 5, 8))
    assert aten.cat.default in targets and aten.copy_.default not in targets and aten.new_empty.default not in targets


class BroadcastOnCopy(torch.nn.Module):
    def forward(self, k_nope, k_rot):
        keys = torch.zeros(k_nope.shape[0], 4, k_nope.shape[2], 24)
        keys[:, :, :, 16:].copy_(k_rot)  # [B, 1, S, 8] broadcast to 4 heads by copy_
        keys[:, :, :, :16].copy_(k_nope)
        return keys.sum(-1)


def test_implicit_broadcast_and_out_of_order_slices():
    targets = _check(BroadcastOnCopy(), torch.randn(1, 4, 5, 16), torch.randn(1, 1, 5, 8))
    assert aten.cat.default in targets and aten.copy_.default not in targets


class Gap(torch.nn.Module):
    def forward(self, k_nope, k_rot):
        keys = torch.zeros(k_nope.shape[0], 4, k_nope.shape[2], 26)
        keys[..., :16].copy_(k_nope)
        keys[..., 18:].copy_(k_rot.expand(-1, 4, -1, -1))  # 16:18 stays zero
        return keys + 1


class ReadBetweenCopies(torch.nn.Module):
    def forward(self, k_nope, k_rot):
        keys = torch.zeros(k_nope.shape[0], 4, k_nope.shape[2], 24)
        keys[..., :16].copy_(k_nope)
        early = keys * 3  # sees the second slice still zero
        keys[..., 16:].copy_(k_rot.expand(-1, 4, -1, -1))
        return keys + early


class WrittenThroughAView(torch.nn.Module):
    def forward(self, k_nope, k_rot):
        keys = torch.zeros(k_nope.shape[0], 4, k_nope.shape[2], 24)
        keys[..., :16].copy_(k_nope)
        keys[..., 16:].copy_(k_rot.expand(-1, 4, -1, -1))
        keys.view(-1).mul_(2.0)
        return keys + 1


def test_fills_that_are_not_a_plain_cat_are_left_alone():
    for module in (Gap(), ReadBetweenCopies(), WrittenThroughAView()):
        targets = _check(module, torch.randn(1, 4, 5, 16), torch.randn(1, 1, 5, 8))
        assert aten.copy_.default in targets, type(module).__name__
