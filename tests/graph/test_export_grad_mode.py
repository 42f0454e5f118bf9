"""Export skips grad-mode sets that change nothing (HF's ``@torch.no_grad()`` under our ambient no_grad):
recorded, they make export split and re-inline the whole graph (~20% of a 32-layer export)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from autodeploy.export import _SkipRedundantGradModeSets, export_model
from autodeploy.model_loading import build_meta_model
from autodeploy.tiny import tiny_config

split_pass = pytest.importorskip("torch._export.passes.replace_set_grad_with_hop_pass")


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.grad_sets: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._set_grad_enabled:
            self.grad_sets.append(bool(args[0]))
        return func(*args, **(kwargs or {}))


def test_only_real_grad_mode_changes_pass_through():
    with torch.no_grad(), _Recorder() as recorder, _SkipRedundantGradModeSets():
        with torch.no_grad():  # already off: dropped
            assert not torch.is_grad_enabled()
        with torch.enable_grad():  # a real change, and the change back
            assert torch.is_grad_enabled()
        assert not torch.is_grad_enabled()
    assert recorder.grad_sets == [True, False]


def _count_graph_splits(monkeypatch) -> list[int]:
    calls = [0]
    real = split_pass.sequential_split

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(split_pass, "sequential_split", counting)
    return calls


class _NoGradRotary(torch.nn.Module):
    @torch.no_grad()
    def forward(self, x):
        return x.cos()


def test_plain_export_splits_at_no_grad(monkeypatch):
    """The control: without the mode, export splits the graph at the decorator's grad-mode nodes."""
    splits = _count_graph_splits(monkeypatch)
    with torch.no_grad():
        torch.export.export(_NoGradRotary(), (torch.randn(2, 4),), strict=False)
    assert splits[0] == 1


def test_llama_export_does_not_split(monkeypatch):
    model, _ = build_meta_model(tiny_config("llama"), torch.float32, "sdpa")
    splits = _count_graph_splits(monkeypatch)
    gm = export_model(model)
    assert splits[0] == 0
    assert not [n for n in gm.graph.nodes if n.target is torch._C._set_grad_enabled]
