"""gather_logits: the LM head reads one row per sequence; the gather moves above the final norm and
residual add, and is the identity when every row is wanted."""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autodeploy.passes.gather_logits import gather_rows
from autodeploy.export import graph_module_from_program
from autodeploy.testing import pass_runner

ops = torch.ops.autodeploy


class FinalNormHead(torch.nn.Module):
    """The tail of a pre-norm decoder: last residual add, final RMSNorm (through fp32), LM head."""

    def __init__(self, hidden=16, vocab=24):
        super().__init__()
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.head = torch.nn.Parameter(torch.randn(vocab, hidden) / 4)

    def forward(self, x, residual):
        h = x + residual
        return F.linear(ops.rms_norm(h.to(torch.float32), self.norm, 1e-6).to(x.dtype), self.head)


class SharedSum(FinalNormHead):
    """The residual sum feeds the norm and a second row-wise branch: the gather stops at it."""

    def forward(self, x, residual):
        h = x + residual
        return F.linear(ops.rms_norm(h, self.norm, 1e-6) + h * 0.5, self.head)


def _gathers(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is gather_rows]


def _run(module, hoist, tokens=5):
    inputs = (torch.randn(1, tokens, 16), torch.randn(1, tokens, 16))
    tokens = torch.export.Dim("tokens", min=1, max=64)
    program = torch.export.export(module.eval(), inputs, dynamic_shapes=({1: tokens}, {1: tokens}),
                                  strict=False)
    gm = graph_module_from_program(program)  # the compiler's plain GraphModule: one output
    pass_runner("gather_logits", hoist=hoist)(gm)
    gm.graph.lint()
    return gm


def test_the_gather_moves_above_the_final_norm_and_add():
    module = FinalNormHead()
    gm = _run(module, hoist=True)
    gathers = _gathers(gm)
    assert sorted(g.args[0].op for g in gathers) == ["placeholder", "placeholder"]  # x and residual
    norm = next(n for n in gm.graph.nodes if n.target == ops.rms_norm.default)
    head = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.aten.index_select.default) == []
    assert head.args[0].target is not gather_rows and not any(u.target is gather_rows for u in norm.users)
    for tokens, rows in ((7, [6, 2]), (3, [2]), (4, [0, 1, 2, 3])):  # the last case: the identity
        x, r = torch.randn(1, tokens, 16), torch.randn(1, tokens, 16)
        want = module(x, r)[:, rows]
        torch.testing.assert_close(gm(x, r, torch.tensor(rows)), want, atol=1e-5, rtol=1e-5)


def test_without_hoisting_the_gather_stays_before_the_head():
    gm = _run(FinalNormHead(), hoist=False)
    (gather,) = _gathers(gm)
    assert gather.args[0].target == torch.ops.aten._to_copy.default or gather.args[0].op == "call_function"
    assert [u.target for u in gather.users] == [torch.ops.aten.linear.default]


def test_the_gather_stops_at_a_value_with_another_consumer():
    module = SharedSum()
    gm = _run(module, hoist=True)
    gathers = _gathers(gm)
    assert gathers and {g.args[0].target for g in gathers} == {torch.ops.aten.add.Tensor}  # h, read twice
    x, r = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    torch.testing.assert_close(gm(x, r, torch.tensor([5, 1])), module(x, r)[:, [5, 1]], atol=1e-5, rtol=1e-5)


def test_gather_rows_is_the_identity_when_every_row_is_wanted():
    hidden = torch.randn(1, 4, 8)
    assert gather_rows(hidden, 1, torch.arange(4)) is hidden
    picked = gather_rows(hidden, 1, torch.tensor([3, 0]))
    assert torch.equal(picked, hidden[:, [3, 0]])


def test_gather_rows_under_fake_tensors_keeps_the_gathered_shape():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        tokens = mode.shape_env.create_unbacked_symint()
        hidden = torch.empty(1, tokens, 8)
        out = gather_rows(hidden, 1, torch.empty(2, dtype=torch.int64))
    assert out.shape[1] == 2
