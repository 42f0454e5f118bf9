"""The offline API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

This is a simple loop over a ``CompiledModel``: every step schedules a prefill chunk or one decode
token per unfinished sequence within the token budget, then samples. (The serving engine in
``autodeploy.serve`` adds continuous admission, prefix reuse and preemption.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .compiled import CompiledModel
from .compiler import compile as compile_model
from .kvcache.allocator import BlockAllocator, blocks_needed
from .kvcache.metadata import SequenceChunk


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token from one row of logits (greedy when temperature is 0)."""
    if params.temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


class LLM:
    def __init__(self, model_dir: str, **options: Any):
        self.model: CompiledModel = compile_model(model_dir, **options)
        self.tokenizer = _load_tokenizer(self.model.model_dir)  # the resolved checkpoint (GGUF: converted)
        self.eos_token_ids = _eos_ids(self.model.hf_config, self.tokenizer)

    def generate(
        self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        outputs = [RequestOutput(ids) for ids in self._token_ids(prompts)]
        _GenerationLoop(self.model, params, self.eos_token_ids).run(outputs)
        if self.tokenizer is not None:
            for out in outputs:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return outputs

    def _token_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer in the checkpoint directory; pass token ids instead")
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


class _GenerationLoop:
    def __init__(self, model: CompiledModel, params: SamplingParams, eos_ids: set[int]):
        self.model, self.params = model, params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.allocator = BlockAllocator(model.num_blocks)
        self.generator = torch.Generator(device=model.device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)

    def run(self, outputs: list[RequestOutput]) -> None:
        blocks = {id(o): self.allocator.allocate(self._blocks_for(o)) for o in outputs}
        computed = {id(o): 0 for o in outputs}
        active = [o for o in outputs if self.params.max_tokens > 0]
        while active:
            budget, chunks, scheduled = self.model.config.max_num_tokens, [], []
            for out in active:
                tokens = out.prompt_token_ids + out.token_ids
                todo = tokens[computed[id(out)] :][: max(1, budget)]
                if budget <= 0:
                    break
                chunks.append(SequenceChunk(tuple(todo), computed[id(out)], tuple(blocks[id(out)])))
                scheduled.append(out)
                budget -= len(todo)
            logits = self.model(chunks)
            for row, (out, chunk) in enumerate(zip(scheduled, chunks)):
                computed[id(out)] = chunk.end
                if chunk.end == len(out.prompt_token_ids) + len(out.token_ids):
                    self._append(out, sample(logits[row], self.params, self.generator))
            active = [o for o in active if o.finish_reason is None]
        for out in outputs:
            self.allocator.free(blocks[id(out)])

    def _blocks_for(self, out: RequestOutput) -> int:
        total = len(out.prompt_token_ids) + self.params.max_tokens
        if total > self.model.max_seq_len:
            raise ValueError(f"prompt + max_tokens = {total} exceeds max_seq_len {self.model.max_seq_len}")
        return blocks_needed(total, self.model.block_size)

    def _append(self, out: RequestOutput, token: int) -> None:
        out.token_ids.append(token)
        if token in self.stop_ids:
            out.finish_reason = "stop"
        elif len(out.token_ids) >= self.params.max_tokens:
            out.finish_reason = "length"


def _load_tokenizer(model_dir):
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path)


def _eos_ids(hf_config, tokenizer) -> set[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
