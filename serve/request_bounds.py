"""Whether a request can ever be served: its prompt and token budget against the vocabulary, the
context and the KV pool. The engine checks every request it is given; the API process checks them
before they cross to an engine in its own process, from the bounds that engine reported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autodeploy.kvcache.block_manager import blocks_needed
from autodeploy.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestBounds:
    """What decides whether a request can ever be served: the vocabulary, the context, the KV pool."""

    vocab_size: int
    max_seq_len: int
    num_blocks: int
    block_size: int


def check_request(prompt: Sequence[int], params: SamplingParams, bounds: RequestBounds, has_tokenizer: bool) -> None:
    """Raise ``ValueError`` (a client error) if this request can never be served."""
    if not prompt:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < bounds.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of vocabulary (size {bounds.vocab_size})")
    if params.stop and (not has_tokenizer or not params.detokenize):
        raise ValueError("stop strings need detokenization (a tokenizer)")
    if params.structured is not None and not has_tokenizer:
        raise ValueError("structured outputs need a tokenizer (the grammar is matched against its vocabulary)")
    max_tokens = params.max_tokens or 1
    if len(prompt) + max_tokens > bounds.max_seq_len:
        raise ValueError(context_length_message(bounds.max_seq_len, len(prompt), params.max_tokens))
    if blocks_needed(len(prompt) + max_tokens, bounds.block_size) > bounds.num_blocks:
        raise ValueError(
            f"the KV cache holds {bounds.num_blocks * bounds.block_size} tokens; this request needs "
            f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} in the completion)"
        )


def context_length_message(max_len: int, prompt_len: int, max_tokens: int | None) -> str:
    """The error text clients (and lm-eval) look for: it names "maximum context length"."""
    requested = prompt_len + (max_tokens or 0)
    return (
        f"This model's maximum context length is {max_len} tokens. However, you requested {requested} tokens "
        f"({prompt_len} in the prompt, {max_tokens or 0} in the completion). "
        "Please reduce the length of the prompt or completion."
    )
