"""The Hugging Face peers of the offline rows: ``model.generate`` as an HF user runs a batch job.

- ``hf_eager``: ``generate`` with its default DynamicCache, nothing compiled;
- ``hf_static``: ``generate(cache_implementation="static")``, for which transformers compiles the decode
  forward itself (its auto-compile: ``torch.compile``, mode ``reduce-overhead``, CUDA graphs) on CUDA.

Requests run in batches of ``batch`` prompts of one length (random ids: no padding), each to exactly
``output_len`` tokens. One warm-up ``generate`` of the timed shape, stopped after a few tokens, runs first:
it holds the static peer's compile, which is left out of the timing as autodeploy's compile is.
"""

from __future__ import annotations

import time

import torch

IMPLS = ("hf_eager", "hf_static")
WARM_UP_TOKENS = 3


class _StopAfter:
    """A stopping criterion: ``tokens`` new tokens past a ``prompt_len`` prompt (the warm-up's early end,
    which keeps the timed run's cache length, so the static peer compiles the shape it is timed on)."""

    def __init__(self, prompt_len: int, tokens: int):
        self.end = prompt_len + tokens

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.end, dtype=torch.bool,
                          device=input_ids.device)


def generate_batch(model, prompts: torch.Tensor, output_len: int, impl: str, stop_after: int | None = None):
    """Greedy ``generate`` of exactly ``output_len`` tokens per row (EOS suppressed until then)."""
    from transformers import StoppingCriteriaList

    if impl not in IMPLS:
        raise ValueError(f"unknown HF peer {impl!r}; expected one of {IMPLS}")
    criteria = StoppingCriteriaList([_StopAfter(prompts.shape[1], stop_after)] if stop_after else [])
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=0, stopping_criteria=criteria,
                          cache_implementation="static" if impl == "hf_static" else None)


@torch.inference_mode()
def hf_offline(model, impl: str, input_len: int, output_len: int, num_requests: int, batch: int,
               seed: int = 0) -> tuple[float, int]:
    """(seconds, requests run): ``num_requests`` random prompts in batches of ``batch``, after one warm-up.

    Every batch must come back ``input_len + output_len`` long: a shorter one would flatter the rate."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (num_requests, input_len), generator=gen).to(model.device)
    batch = min(batch, num_requests)
    if num_requests % batch:  # a smaller last batch would be a new static cache shape: a compile inside the timing
        raise ValueError(f"{num_requests} requests do not split into batches of {batch}")
    generate_batch(model, prompts[:batch], output_len, impl, stop_after=WARM_UP_TOKENS)
    _sync(model.device)
    start = time.perf_counter()
    for first in range(0, num_requests, batch):
        out = generate_batch(model, prompts[first:first + batch], output_len, impl)
        if out.shape[1] != input_len + output_len:
            raise RuntimeError(f"{impl}: generate returned {out.shape[1] - input_len} tokens, not {output_len}")
    _sync(model.device)
    return time.perf_counter() - start, num_requests


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
