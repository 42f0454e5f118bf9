"""Batched sampling on the device: one logits row per sequence in, one token id per row out.

All per-request parameters travel to the device as small tensors built in pinned host memory and
copied without blocking, so nothing here waits for the device: the only synchronization of a
step is reading the sampled ids (and requested log-probabilities) back, in
:meth:`PendingTokens.wait`.

Order of processing (as vLLM): a grammar's allowed-token bitmask (structured outputs), penalties and
``min_tokens`` masking on the raw logits (greedy decoding sees them too), then temperature,
top-k/top-p, min-p, and finally a draw by the exponential-race trick: ``argmax(probs / q)`` with
``q ~ Exp(1)`` is a sample from ``probs``. Each seeded request draws its ``q`` from its own
generator, so its tokens do not depend on what else is in the batch. Reported log-probabilities are
those of the model's distribution (a grammar's excluded tokens at -inf, as vLLM reports them).
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from autodeploy.kernels.argmax import argmax_rows

from .sequence import Sequence
from .structured import StructuredOutputs, apply_token_bitmask


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V]: on CUDA the two-pass Triton argmax (torch reduces a row in
    one thread block: 36 us for one 128k-vocabulary row on an H200), torch's elsewhere."""
    return argmax_rows(logits) if logits.is_cuda else logits.argmax(dim=-1)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied from pinned memory without blocking the host."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class PendingTokens:
    """Device results on their way to the host; :meth:`wait` is the step's one synchronization."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._host = {name: _copy_to_host(t) for name, t in tensors.items()}
        self._event = None
        if any(t.is_cuda for t in tensors.values()):
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> dict[str, list]:
        if self._event is not None:
            self._event.synchronize()
        return {name: t.tolist() for name, t in self._host.items()}


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, structured: StructuredOutputs | None = None):
        self.vocab_size = vocab_size
        self.device = device
        self.structured = structured

    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence], previous=None) -> dict[str, torch.Tensor]:
        """Token ids ``[B]`` (and log-probabilities if any row wants them), still on the device. Rows with a
        grammar sample only tokens it allows (``previous``: the step in flight, see ``structured``)."""
        params = [s.params for s in seqs]
        if self.structured is not None:
            masks = self.structured.bitmask(seqs, previous)
            if masks is not None:
                logits = apply_token_bitmask(logits, *masks)
        if all(p.greedy and p.logprobs is None and not p.uses_penalties and not p.min_tokens for p in params):
            # the common case, kept to the argmax alone, in the model's dtype (exact in fp32 too)
            return {"token_ids": greedy_ids(logits)}
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, seqs)
        if any(p.min_tokens for p in params):
            logits = self._mask_early_stops(logits, seqs)
        token_ids = greedy_ids(logits)
        if not all(p.greedy for p in params):
            token_ids = torch.where(
                to_device([p.greedy for p in params], torch.bool, self.device), token_ids, self._draw(logits, seqs)
            )
        out = {"token_ids": token_ids}
        if raw_logprobs is not None:
            out.update(_logprobs(raw_logprobs, token_ids, max(p.logprobs or 0 for p in params)))
        return out

    def _draw(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, self.device)
        logits = logits / temps[:, None]
        if any(p.uses_top_k_top_p for p in params):
            top_k = to_device([min(p.top_k, self.vocab_size) or self.vocab_size for p in params], torch.int64,
                              self.device)
            top_p = to_device([p.top_p for p in params], torch.float32, self.device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], torch.float32, self.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        return greedy_ids(probs / noise)

    def _apply_penalties(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        # rows without penalties count nothing: their ids may still be placeholders (async scheduling)
        output_counts = self._token_counts([s.output_token_ids if s.params.uses_penalties else [] for s in seqs])
        seen = (self._token_counts([s.token_ids if s.params.uses_penalties else [] for s in seqs]) > 0) if any(
            p.repetition_penalty != 1 for p in params) else None
        freq = to_device([p.frequency_penalty for p in params], torch.float32, self.device)[:, None]
        presence = to_device([p.presence_penalty for p in params], torch.float32, self.device)[:, None]
        logits = logits - freq * output_counts - presence * (output_counts > 0)
        if seen is not None:
            rep = to_device([p.repetition_penalty for p in params], torch.float32, self.device)[:, None]
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalized, logits)
        return logits

    def _token_counts(self, token_lists: list[list[int]]) -> torch.Tensor:
        """``[B, V]`` occurrence counts; padding goes to an extra column that is dropped."""
        width = max(1, max(len(t) for t in token_lists))
        padded = [t + [self.vocab_size] * (width - len(t)) for t in token_lists]
        ids = to_device(padded, torch.int64, self.device)
        counts = torch.zeros(len(token_lists), self.vocab_size + 1, device=self.device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        return counts[:, : self.vocab_size]

    def _mask_early_stops(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """Before ``min_tokens`` are out, EOS and stop token ids cannot be chosen."""
        rows, cols = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                stops = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else seq.request.eos_token_ids)
                stops = [t for t in stops if t < self.vocab_size]
                rows += [row] * len(stops)
                cols += stops
        if not rows:
            return logits
        index = (to_device(rows, torch.int64, self.device), to_device(cols, torch.int64, self.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=self.device))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (k = vocab, p = 1: no-op)."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the kept tokens are at the end
    vocab = logits.shape[-1]
    kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside_nucleus = cumulative <= (1 - top_p)[:, None]
    outside_nucleus[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    out = {"logprob": logprobs.gather(1, token_ids[:, None])[:, 0]}
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        out["top_logprob"], out["top_token_id"] = top.values, top.indices
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Log-probabilities of ``next_ids`` under each row of ``logits`` (and the top ``k``)."""
    return {f"prompt_{name}": t for name, t in _logprobs(torch.log_softmax(logits.float(), dim=-1), next_ids, k).items()}
