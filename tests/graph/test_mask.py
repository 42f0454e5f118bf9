"""Mask classification is proven for every length up to max_seq_len, or refused.

Masks that equal plain causal attention up to 64, 512 or 4096 tokens and differ past that (a chunk, a
sliding window, something no kernel computes) are classified as what they are, or refused: never
taken for causal attention because the first lengths looked causal. The size they change at comes
from the model config (a hint) or only from the mask's own computation (its constants)."""

import pytest
import torch

from autodeploy.errors import UnsupportedPatternError
from autodeploy.graph.mask import (FULL_EVAL_TOKENS, MaskKind, MaskTerm, classify_mask, classify_allowed,
                                   probe_lengths)
from autodeploy.testing import export_for_test

MIN = torch.finfo(torch.float32).min


def chunked(size):
    return lambda q, k: (q >= k) & (q // size == k // size)


def sliding(size):
    return lambda q, k: (q >= k) & (q - k < size)


def sink_dropped_past(size):
    """Causal, except that queries past ``size`` no longer see the first key: no kernel's pattern."""
    return lambda q, k: (q >= k) & ~((q >= size) & (k == 0))


class MaskOf(torch.nn.Module):
    """An additive [1, 1, T, T] mask computed from positions, as HF's masking utilities compute them."""

    def __init__(self, allowed):
        super().__init__()
        self.allowed = allowed

    def forward(self, position_ids):
        allowed = self.allowed(position_ids[:, None], position_ids[None, :])
        return torch.where(allowed, 0.0, MIN)[None, None]


def _output(gm):
    return torch.utils._pytree.tree_leaves(gm.graph.output_node().args)[0]


def classify(allowed, max_seq_len: int, config_sizes=()) -> MaskKind:
    gm = export_for_test(MaskOf(allowed), (torch.arange(8),), dynamic={0: 0})
    gm.meta.update(autodeploy_max_seq_len=max_seq_len, autodeploy_size_hints=config_sizes)
    return classify_mask(gm, [MaskTerm(_output(gm))])


@pytest.mark.parametrize("size, config_names_it", [
    (64, False), (64, True), (512, False), (512, True),
    pytest.param(4096, False, marks=pytest.mark.slow),  # three masks at 8193 tokens: 67 M pairs each
], ids=["64-in-the-mask", "64-in-the-config", "512-in-the-mask", "512-in-the-config", "4096-in-the-mask"])
def test_masks_that_differ_from_causal_only_past_a_size(size, config_names_it):
    hints = (size,) if config_names_it else ()
    assert classify(chunked(size), 2 * size + 8, hints) == MaskKind(True, chunk_size=size)
    assert classify(sliding(size), 2 * size + 8, hints) == MaskKind(True, sliding_window=size)
    with pytest.raises(UnsupportedPatternError):
        classify(sink_dropped_past(size), 2 * size + 8, hints)


def test_a_size_past_max_seq_len_changes_nothing_the_engine_runs():
    assert classify(chunked(512), 512) == MaskKind(causal=True)
    assert classify(sliding(4096), 600) == MaskKind(causal=True)


def test_masks_are_evaluated_whole_up_to_the_evaluation_limit():
    """A size the mask hides from its constants (read from a large constant tensor) is still found
    where max_seq_len is evaluated whole."""
    hidden = torch.full((64,), 3000)

    def chunks_of_a_hidden_size(q, k):
        return (q >= k) & (q // hidden[0] == k // hidden[0])

    assert classify(chunks_of_a_hidden_size, FULL_EVAL_TOKENS) == MaskKind(True, chunk_size=3000)


def test_probe_lengths_cross_every_size_once_and_twice():
    assert probe_lengths(100_000, [8, 512, 3]) == [4, 7, 9, 17, 64, 513, 1025, FULL_EVAL_TOKENS]
    assert probe_lengths(40, [8, 512]) == [9, 17, 40]  # sizes past max_seq_len: nothing to probe
    assert probe_lengths(30, [20]) == [21, 30]  # past twice would be past max_seq_len
    assert probe_lengths(100_000, [8192]) == [64, FULL_EVAL_TOKENS, 8193, 16385]  # Llama-4's chunk
    with pytest.raises(UnsupportedPatternError, match="max_seq_len <= 100000"):
        probe_lengths(1_000_000, [100_000])


def test_a_pattern_that_changes_with_the_length_is_refused():
    class LengthDependent(torch.nn.Module):
        def forward(self, position_ids):  # a window of half the sequence: no fixed kind
            q, k = position_ids[:, None], position_ids[None, :]
            allowed = (q >= k) & (q - k < position_ids.shape[0] // 2)
            return torch.where(allowed, 0.0, MIN)[None, None]

    gm = export_for_test(LengthDependent(), (torch.arange(8),), dynamic={0: 0})
    gm.meta["autodeploy_max_seq_len"] = 256
    with pytest.raises(UnsupportedPatternError, match="changes with the sequence length"):
        classify_mask(gm, [MaskTerm(_output(gm))])


@pytest.mark.parametrize("allowed, kind", [
    (torch.ones(5, 5, dtype=torch.bool).tril(), MaskKind(True)),
    (MaskKind(True, sliding_window=3).allowed(9), MaskKind(True, sliding_window=3)),
    (MaskKind(True, chunk_size=4).allowed(9), MaskKind(True, chunk_size=4)),
])
def test_classify_allowed(allowed, kind):
    assert classify_allowed(allowed) == kind


def test_bidirectional_and_other_patterns_fail_loudly():
    with pytest.raises(UnsupportedPatternError, match="bidirectional"):
        classify_allowed(torch.ones(4, 4, dtype=torch.bool))
    no_diagonal = torch.ones(4, 4, dtype=torch.bool).tril(-1)
    with pytest.raises(UnsupportedPatternError, match="neither causal"):
        classify_allowed(no_diagonal)
