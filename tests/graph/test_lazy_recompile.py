"""The captured GraphModule regenerates its Python code lazily: ``recompile()`` after a rewrite costs
nothing until the module runs or its code is read, and then the new graph is what runs."""

import torch
import torch.nn.functional as F

from autodeploy.export import graph_module_from_program

aten = torch.ops.aten


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _captured(module, x):
    return graph_module_from_program(torch.export.export(module.eval(), (x,), strict=False))


def _count_regenerations(gm, monkeypatch) -> list[int]:
    calls = [0]
    real = type(gm)._real_recompile

    def counting(self):
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(type(gm), "_real_recompile", counting)
    return calls


def test_recompile_defers_until_the_module_runs(monkeypatch):
    torch.manual_seed(0)
    module, x = TwoLinears(), torch.randn(3, 8)
    gm = _captured(module, x)
    torch.testing.assert_close(gm(x), module(x))
    regenerations = _count_regenerations(gm, monkeypatch)
    (relu,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
    relu.target = aten.sigmoid.default
    for _ in range(5):  # a pass's rewrites, each followed by recompile()
        gm.recompile()
    assert regenerations[0] == 0
    expected = module.b(torch.sigmoid(module.a(x)))
    torch.testing.assert_close(gm(x), expected)  # the edited graph runs, not the stale code
    assert regenerations[0] == 1
    torch.testing.assert_close(gm(x), expected)
    assert regenerations[0] == 1  # regenerated once, then reused


def test_reading_the_code_regenerates_it():
    gm = _captured(TwoLinears(), torch.randn(3, 8))
    (relu,) = gm.graph.find_nodes(op="call_function", target=aten.relu.default)
    relu.target = aten.sigmoid.default
    gm.recompile()
    assert "aten.sigmoid" in gm.code and "aten.relu" not in gm.code
