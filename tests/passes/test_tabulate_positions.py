"""tabulate_positions: values computed from the positions alone become a table and a row gather,
bit for bit; values that are lookups already, not row by row, or too large stay."""

import pytest
import torch
from torch import nn

from autodeploy.testing import check_rewrite, pass_runner

aten = torch.ops.aten
ROWS = 64  # max_seq_len of the tests' context (tokens_per_block divides it)


def _run(**settings):
    return pass_runner("tabulate_positions", artifacts={"max_seq_len": ROWS}, **settings)


def _inputs(tokens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 8, generator=generator), torch.randint(0, ROWS, (tokens,), generator=generator)


class LlamaRotary(nn.Module):
    """HF Llama's rotary embedding applied to x: inv_freq @ positions, concat, cos/sin, scaling, cast."""

    def __init__(self, scaling=1.0, dtype=torch.float32):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)
        self.scaling, self.dtype = scaling, dtype

    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[None, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)
        half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
        return x * cos[0] + half * sin[0]


def test_rotary_cos_and_sin_become_two_gathers():
    module = LlamaRotary(scaling=0.7)
    check = check_rewrite(module, _inputs(9), _run(), expected_matches=2, second_inputs=_inputs(23, seed=1),
                          dynamic={0: 0, 1: 0}, atol=0, rtol=0)
    targets = [n.target for n in check.gm.graph.nodes if n.op == "call_function"]
    assert aten.cos.default not in targets and aten.sin.default not in targets
    assert targets.count(aten.index_select.default) == 2
    tables = [b for name, b in check.gm.named_buffers() if name.startswith("position_table")]
    assert [tuple(t.shape) for t in tables] == [(1, ROWS, 8)] * 2


class DynamicRotary(LlamaRotary):
    """A frequency that depends on the longest position of the step: not row by row."""

    def forward(self, x, position_ids):
        longest = position_ids.max().float() + 1.0
        emb = (position_ids[:, None].float() / longest) * self.inv_freq.repeat(2)[None, :]
        return x * emb.cos() + x * emb.sin()


class LearnedPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(ROWS, 8)

    def forward(self, x, position_ids):
        return x + self.wpe(position_ids)


class PositionTotals(nn.Module):
    """A value that does not follow the tokens: one number for the whole step."""

    def forward(self, x, position_ids):
        return x * position_ids.float().cos().sum()


@pytest.mark.parametrize("module", [DynamicRotary(), LearnedPositions(), PositionTotals()],
                         ids=["not-row-by-row", "lookup-already", "no-token-dim"])
def test_values_that_are_not_tables_stay(module):
    check = check_rewrite(module, _inputs(9), _run(), expected_matches=0, second_inputs=_inputs(23, seed=1),
                          dynamic={0: 0, 1: 0}, atol=0, rtol=0)
    assert not any(name.startswith("position_table") for name, _ in check.gm.named_buffers())


def test_tables_over_the_size_limit_stay():
    check_rewrite(LlamaRotary(), _inputs(9), _run(max_table_mb=0), expected_matches=0, dynamic={0: 0, 1: 0})


def test_a_graph_without_positions_is_left_alone():
    class NoPositions(nn.Module):
        def forward(self, x, other):
            return x * other.float().cos()[:, None]

    check_rewrite(NoPositions(), _inputs(9), _run(), expected_matches=0, dynamic={0: 0, 1: 0})
