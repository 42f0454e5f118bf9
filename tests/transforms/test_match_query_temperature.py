"""match_query_temperature: Llama-4's query scale from ``arange(seq_len)`` reads ``position_ids`` instead
(the token positions; ``arange`` over a flattened step's tokens is wrong for every chunk and decode)."""

import torch

from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_query_temperature import MatchQueryTemperature

FLOOR_SCALE, ATTN_SCALE = 4, 0.1


def _temperature(positions: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.floor((positions.float() + 1.0) / FLOOR_SCALE)) * ATTN_SCALE + 1.0


class TemperatureTunedQuery(torch.nn.Module):
    """The lines of Llama4TextAttention.forward (attention temperature tuning of NoPE layers)."""

    def __init__(self, positions_from=None):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.position_embedding = torch.nn.Embedding(64, 16)  # (ties position_ids to the tokens of x)
        self.positions_from = positions_from

    def forward(self, x, position_ids):
        x = x + self.position_embedding(position_ids)
        positions = torch.arange(x.shape[1]) + 0  # arange(seq_len) + past_seen_tokens (no cache)
        if self.positions_from is not None:
            positions = self.positions_from(x, position_ids)
        scales = _temperature(positions).view(1, x.shape[1], 1)
        return (self.q(x) * scales).to(x.dtype)


def _inputs(n: int, start: int = 0):
    return torch.randn(1, n, 16), torch.arange(start, start + n)


def test_the_scale_reads_position_ids():
    module = TemperatureTunedQuery()
    check = check_rewrite(module, _inputs(9), MatchQueryTemperature(), expected_matches=1, second_inputs=_inputs(5),
                          dynamic={0: 1, 1: 0})
    assert check.count(torch.ops.aten.arange.default) + check.count(torch.ops.aten.arange.start) == 0
    x, positions = _inputs(3, start=29)  # a decode-like step: positions past the step's token count
    want = module.q(x + module.position_embedding(positions)) * _temperature(positions).view(1, 3, 1)
    torch.testing.assert_close(check.gm(x, positions), want)


def test_other_positions_are_left_alone():
    """A scale from position_ids already, or from an arange that is not the tokens' (a fixed range)."""
    from_ids = TemperatureTunedQuery(lambda x, ids: ids)
    fixed = TemperatureTunedQuery(lambda x, ids: torch.arange(2, 2 + x.shape[1]))
    for module, reason in ((from_ids, "already reads position_ids"), (fixed, "not arange over the step's tokens")):
        check = check_rewrite(module, _inputs(6), MatchQueryTemperature(), expected_matches=0,
                              second_inputs=_inputs(4), dynamic={0: 1, 1: 0})
        assert any(reason in r for r in check.result.reasons), check.result.reasons
