import math

import pytest
import torch

from autodeploy import SamplingParams
from autodeploy.serve.sampler import Sampler, apply_top_k_top_p
from autodeploy.serve.sequence import Request, new_sequences

VOCAB = 8
EOS = 7


def _seq(params: SamplingParams, prompt=(1, 2), output=(), seed_index=0):
    request = Request("r", tuple(prompt), params, 0.0, frozenset({EOS}), 100)
    seq = new_sequences(request, None)[seed_index]
    seq.token_ids.extend(output)
    if params.seed is not None:
        seq.generator = torch.Generator().manual_seed(params.seed + seq.index)
    return seq


def _sample(logits, seqs):
    return Sampler(VOCAB, torch.device("cpu")).sample(torch.as_tensor(logits, dtype=torch.float32), seqs)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]]))
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.6]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True]  # top-2: 0.4, 0.3
    assert torch.isfinite(out[1]).tolist() == [False, True, False, True]  # nucleus 0.6: 0.4 + 0.3


def test_greedy_rows_take_the_argmax_and_mix_with_sampled_rows():
    logits = [[0, 5, 1, 0, 0, 0, 0, 0], [0, 0, 0, 9, 0, 0, 0, 0]]
    out = _sample(logits, [_seq(SamplingParams(temperature=0)), _seq(SamplingParams(temperature=0.01, seed=1))])
    assert out["token_ids"].tolist() == [1, 3]


def test_plain_greedy_is_the_argmax_in_the_model_dtype():
    """The fast path (no logprobs, penalties or min_tokens) skips the fp32 copy of the logits: same ids."""
    logits = torch.randn(16, 1000).to(torch.bfloat16)
    logits[3] = -1.0
    logits[3, 10] = logits[3, 20] = 1.0  # a tie: both paths take the first index
    seqs = [_seq(SamplingParams(temperature=0)) for _ in range(16)]
    out = Sampler(1000, torch.device("cpu")).sample(logits, seqs)
    assert list(out) == ["token_ids"] and out["token_ids"].tolist() == logits.float().argmax(-1).tolist()
    assert out["token_ids"][3] == 10
    seqs[-1] = _seq(SamplingParams(temperature=0, logprobs=1))  # the general path
    with_logprobs = Sampler(1000, torch.device("cpu")).sample(logits, seqs)
    assert with_logprobs["token_ids"].tolist() == out["token_ids"].tolist() and "logprob" in with_logprobs


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0, 0, 0, 0])
    logits = torch.log(probs).expand(4000, -1)
    seqs = [_seq(SamplingParams(temperature=1.0)) for _ in range(4000)]
    counts = torch.bincount(_sample(logits, seqs)["token_ids"], minlength=VOCAB).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(3, VOCAB)
    alone = _sample(logits[1:2], [_seq(SamplingParams(seed=42))])["token_ids"].item()
    batched = _sample(logits, [_seq(SamplingParams()), _seq(SamplingParams(seed=42)), _seq(SamplingParams(seed=3))])
    assert batched["token_ids"][1].item() == alone


def test_repetition_and_frequency_penalties_change_the_greedy_choice():
    logits = [[0, 2.0, 1.9, 0, 0, 0, 0, 0]]
    assert _sample(logits, [_seq(SamplingParams(temperature=0), output=(1,))])["token_ids"].item() == 1
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert _sample(logits, [_seq(rep, prompt=(1,))])["token_ids"].item() == 2  # prompt tokens count for it
    freq = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert _sample(logits, [_seq(freq, prompt=(1,))])["token_ids"].item() == 1  # ... but not for frequency
    assert _sample(logits, [_seq(freq, output=(1,))])["token_ids"].item() == 2


def test_min_tokens_masks_eos_and_stop_ids():
    logits = [[0, 0, 0, 0, 0, 5, 0, 9]]
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,))
    assert _sample(logits, [_seq(params, output=(1,))])["token_ids"].item() not in (5, EOS)
    assert _sample(logits, [_seq(params, output=(1, 1))])["token_ids"].item() == EOS


def test_logprobs_are_those_of_the_raw_distribution():
    logits = torch.randn(2, VOCAB)
    out = _sample(logits, [_seq(SamplingParams(temperature=0, logprobs=3)), _seq(SamplingParams(temperature=0))])
    expected = torch.log_softmax(logits, -1)
    assert out["logprob"].tolist() == pytest.approx(expected.max(-1).values.tolist(), abs=1e-6)
    assert out["top_token_id"][0].tolist() == expected[0].topk(3).indices.tolist()
    assert math.isclose(out["top_logprob"][0, 0].item(), expected[0].max().item(), abs_tol=1e-6)
