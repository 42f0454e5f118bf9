import dataclasses

import pytest

from autodeploy import SamplingParams


def test_defaults_and_normalized_spellings():
    p = SamplingParams(stop="END", stop_token_ids=[5, 6], top_k=-1)
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6) and p.top_k == 0
    assert not p.greedy and not p.uses_penalties and not p.uses_top_k_top_p
    assert SamplingParams(temperature=0).greedy


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().n = 2


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 0, "n must be"),
        ("max_tokens", 0, "max_tokens"),
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_k", -2, "top_k"),
        ("min_p", 1.5, "min_p"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("logprobs", 21, "logprobs"),
        ("prompt_logprobs", -1, "prompt_logprobs"),
        ("stop", ("",), "stop strings"),
        ("stop_token_ids", (-1,), "stop_token_ids"),
        ("seed", -1, "seed"),
        ("min_tokens", 20, "min_tokens"),
    ],
)
def test_invalid_values_are_rejected_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
