import torch

from autodeploy.testing import check_rewrite
from autodeploy.transforms.fuse_gate_up import fuse_gate_up

SWIGLU = torch.ops.autodeploy.swiglu.default
SWIGLU_DOWN = torch.ops.autodeploy.swiglu_down.default
LINEAR = torch.ops.aten.linear.default


class CanonicalMLP(torch.nn.Module):
    """What canonicalize_mlp leaves: the swiglu op on separate parameters."""

    def __init__(self, activation="silu"):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.randn(24, 16))
        self.up = torch.nn.Parameter(torch.randn(24, 16))
        self.down = torch.nn.Parameter(torch.randn(16, 24))
        self.activation = activation

    def forward(self, x):
        return torch.ops.autodeploy.swiglu(x, self.gate, self.up, self.down, self.activation)


class Phi3MLP(torch.nn.Module):
    """Phi-3 stores gate and up stacked: the canonical op reads two row slices of one parameter."""

    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(48, 16))
        self.down = torch.nn.Parameter(torch.randn(16, 24))

    def forward(self, x):
        return torch.ops.autodeploy.swiglu(x, self.gate_up[:24], self.gate_up[24:], self.down, "silu")


def _fuse(gm):
    return fuse_gate_up(gm)[0]


def test_separate_gate_and_up_are_stacked():
    check = check_rewrite(CanonicalMLP("gelu_tanh"), (torch.randn(1, 4, 16),), _fuse, expected_matches=1,
                          second_inputs=(torch.randn(1, 6, 16),), dynamic={0: 1}, atol=1e-4)
    assert (check.count(SWIGLU), check.count(LINEAR), check.count(SWIGLU_DOWN)) == (0, 1, 1)
    params = dict(check.gm.named_parameters())
    assert set(params) == {"fused_gate_up", "down"} and tuple(params["fused_gate_up"].shape) == (48, 16)


def test_already_stacked_weight_is_used_as_is():
    check = check_rewrite(Phi3MLP(), (torch.randn(5, 16),), _fuse, expected_matches=1, atol=1e-4)
    assert (check.count(LINEAR), check.count(SWIGLU_DOWN)) == (1, 1)
    assert set(dict(check.gm.named_parameters())) == {"gate_up", "down"}
    _, fused = fuse_gate_up(check.gm)
    assert fused == []


def test_claimed_weights_stay_separate():
    claimed = lambda gm: fuse_gate_up(gm, can_fuse=lambda name: name != "up")[0]  # noqa: E731
    check = check_rewrite(CanonicalMLP(), (torch.randn(3, 16),), claimed, expected_matches=0)
    assert check.count(SWIGLU) == 1
