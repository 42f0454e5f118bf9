"""match_lightning_attention on HF's own MiniMax layer (one block from the zero state, as export sees a
step shorter than a block) and on both spellings of the pattern; what it must leave alone: a layer
exported over two blocks (refused then by check_uncached_state, naming it), decays that are not the
layer's buffers, a layer without its ``slope_rate`` buffer, a batch of two sequences. The layer over several blocks and decode steps is checked
against HF in tests/kernels/test_lightning_reference.py and by the zoo (``minimax``)."""

import pytest
import torch

from autodeploy.errors import PassError
from autodeploy.graph.rewrite import apply_rule
from autodeploy.testing import check_rewrite, export_for_test, pass_runner
from autodeploy.tiny import tiny_config
from autodeploy.transforms import match_lightning
from autodeploy.transforms.match_lightning import MatchLightningAttention, decay_buffers

ad = torch.ops.autodeploy


class _HFLayer(torch.nn.Module):
    """HF's ``MiniMaxLightningAttention`` on [T, hidden] (no cache: the block loop), random weights."""

    def __init__(self, block_size: int):
        from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

        super().__init__()
        torch.manual_seed(0)
        self.attn = MiniMaxLightningAttention(tiny_config("minimax", block_size=block_size), 0)
        for p in self.attn.parameters():
            torch.nn.init.normal_(p, std=0.2)

    def forward(self, hidden):
        return self.attn(hidden[None], None, None)[0][0]


def test_hf_layer_matches_and_equals_eager():
    """Exported at 8 tokens, checked at 8 and 13 (the exported module guards T <= block: HF's graph of
    one block is wrong past it; the compiled model runs past it, see the module docstring)."""
    check = check_rewrite(_HFLayer(block_size=16), (torch.randn(8, 64),), MatchLightningAttention(),
                          expected_matches=1, second_inputs=(torch.randn(13, 64),), dynamic={0: 0})
    (op,) = check.gm.graph.find_nodes(op="call_function", target=ad.lightning_attention.default)
    assert [tuple(a.meta["val"].shape[1:]) for a in op.args] == [(4, 16), (4, 16), (4, 16), ()]


class _Block(torch.nn.Module):
    """A pattern function over the decay buffers of random slopes, ``slope_rate`` beside them as in HF."""

    def __init__(self, fn, heads=2, buffer=6, slope_rate=True):
        super().__init__()
        self.fn = fn
        slopes = torch.rand(heads) + 0.05
        query_decay, diagonal_decay = decay_buffers(slopes, buffer)
        self.register_buffer("query_decay", query_decay)
        self.register_buffer("diagonal_decay", diagonal_decay)
        if slope_rate:
            self.register_buffer("slope_rate", slopes[:, None, None])

    def forward(self, q, k, v):
        return self.fn(q, k, v, self.query_decay, self.diagonal_decay)


_TOKENS = {0: 2, 1: 2, 2: 2}  # q, k, v [B, H, T, D]: T dynamic


def _qkv(tokens, batch=1):
    return tuple(torch.randn(batch, 2, tokens, 3) for _ in range(3))


@pytest.mark.parametrize("fn", [match_lightning.first_block_zeros_to, match_lightning.first_block_zeros_like],
                         ids=["5.17_zeros_to", "5.25_zeros_in_dtype"])
def test_both_spellings_match(fn):
    check_rewrite(_Block(fn), _qkv(3), MatchLightningAttention(), expected_matches=1, second_inputs=_qkv(4),
                  dynamic=_TOKENS)


def test_decays_that_are_not_buffers_are_left_alone():
    class FromInputs(torch.nn.Module):
        def forward(self, q, k, v, slopes):
            query_decay, diagonal_decay = decay_buffers(slopes, 6)
            return match_lightning.first_block_zeros_to(q, k, v, query_decay, diagonal_decay)

    inputs = (*_qkv(3), torch.rand(2))
    check = check_rewrite(FromInputs(), inputs, MatchLightningAttention(), expected_matches=0, dynamic=_TOKENS)
    assert [r.split(": ", 1)[1] for r in check.result.reasons] == ["the decays are not the layer's buffers"]


def test_a_layer_without_its_slopes_is_left_alone():
    check = check_rewrite(_Block(match_lightning.first_block_zeros_to, slope_rate=False), _qkv(3),
                          MatchLightningAttention(), expected_matches=0, dynamic=_TOKENS)
    assert [r.split(": ", 1)[1] for r in check.result.reasons] == [
        "no slope_rate buffer of one slope per head beside query_decay"]


def test_two_sequences_are_left_alone():
    block = _Block(match_lightning.first_block_zeros_to)
    check = check_rewrite(block, _qkv(3, batch=2), MatchLightningAttention(), expected_matches=0, dynamic=_TOKENS)
    assert check.result.reasons and "not one sequence" in check.result.reasons[0]


def test_a_layer_exported_over_two_blocks_is_left_alone_and_refused():
    gm = export_for_test(_HFLayer(block_size=4), (torch.randn(8, 64),), {0: 0})
    assert apply_rule(gm, MatchLightningAttention(), provenance="test").matches == 0
    refusal = r"the layer with state the KV cache does not hold in attn \(MiniMaxLightningAttention\) is not supported"
    with pytest.raises(PassError, match=r"check_uncached_state' failed: " + refusal):
        pass_runner("check_uncached_state")(gm)
