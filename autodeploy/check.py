"""The correctness canary: the compiled model against HF eager on the same weights.

HF eager (attention "eager", no KV cache) produces the reference: greedy continuations of a batch of
prompts of different lengths, and logits at every position. The compiled model then runs the same
token streams the way the engine would: sequences join at different steps, prompts are prefilled in
chunks mixed with other sequences' decodes, generated tokens are fed back one at a time. Every
logits row the compiled model returns is compared with the reference row at that position, and its
argmax with the reference's greedy token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .compiled import CompiledModel
from .compiler import compile as compile_model
from .kvcache.allocator import BlockAllocator, blocks_needed
from .kvcache.metadata import SequenceChunk
from .model_loading import resolve_model_path

DEFAULT_PROMPT_LENS = (5, 23, 12, 40)


@dataclass
class CheckResult:
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    tokens_compared: int = 0
    tokens_agreed: int = 0
    rows_compared: int = 0
    rel_tol: float = 1e-4
    failures: list[str] = field(default_factory=list)

    @property
    def token_agreement(self) -> float:
        return self.tokens_agreed / max(1, self.tokens_compared)

    @property
    def passed(self) -> bool:
        return self.max_rel_err <= self.rel_tol and self.tokens_agreed == self.tokens_compared and not self.failures

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: {self.rows_compared} logit rows compared, max abs err {self.max_abs_err:.3e}, "
            f"max rel err {self.max_rel_err:.3e} (tolerance {self.rel_tol:.0e}), greedy token agreement "
            f"{self.tokens_agreed}/{self.tokens_compared} ({100 * self.token_agreement:.1f}%)"
        )


def reference_streams(model_dir: Path, prompts: list[list[int]], steps: int, dtype: torch.dtype,
                      quantization: str | None = None):
    """HF eager greedy continuations and logits at every position of prompt + continuation (for a
    quantized checkpoint or ``quantization``, the model ``quantization.reference`` describes)."""
    from .quantization.reference import reference_model

    ref = reference_model(model_dir, dtype, quantization)
    streams, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(steps):
                tokens.append(int(ref(torch.tensor([tokens])).logits[0, -1].argmax()))
            streams.append(tokens)
            logits.append(ref(torch.tensor([tokens])).logits[0].float())
    return streams, logits


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def run_check(
    model_dir: str | Path,
    *,
    steps: int = 16,
    prompt_lens: tuple[int, ...] = DEFAULT_PROMPT_LENS,
    chunk_size: int = 16,
    rel_tol: float = 1e-4,
    compiled: CompiledModel | None = None,
    **compile_options: Any,
) -> CheckResult:
    """Compile (unless ``compiled`` is given) and compare with HF eager; see the module docstring."""
    # the reference reads the same (converted, downloaded) checkpoint
    model_dir = resolve_model_path(model_dir, compile_options.get("revision"),
                                   compile_options.get("allow_pickle", False))
    options = {"dtype": "float32", "device": "cpu", **compile_options}
    options.setdefault("max_seq_len", max(prompt_lens) + steps + 1)
    model = compiled or compile_model(model_dir, **options)
    dtype = model.report.dtype
    prompts = random_prompts(model.vocab_size, prompt_lens)
    streams, ref_logits = reference_streams(model_dir, prompts, steps, dtype, model.config.quantization)
    result = CheckResult(rel_tol=rel_tol)
    _run_streams(model, prompts, streams, ref_logits, chunk_size, result)
    return result


def _run_streams(model: CompiledModel, prompts, streams, ref_logits, chunk_size: int, result: CheckResult) -> None:
    allocator = BlockAllocator(model.num_blocks)
    blocks = [tuple(allocator.allocate(blocks_needed(len(s), model.block_size))) for s in streams]
    if model.num_state_slots and model.num_state_slots < len(streams):
        raise ValueError(f"the canary runs {len(streams)} sequences at once; the state pool holds {model.num_state_slots}")
    slots = list(range(len(streams))) if model.num_state_slots else [-1] * len(streams)  # a state slot each
    done = [0] * len(streams)  # tokens already fed
    ends = [len(s) - 1 for s in streams]  # the last generated token is never fed back
    step = 0
    while any(d < e for d, e in zip(done, ends)):
        batch = [b for b in range(len(streams)) if step >= 2 * b and done[b] < ends[b]]  # staggered joins
        step += 1
        if not batch:
            continue
        chunks = []
        for b in batch:
            n = min(chunk_size, len(prompts[b]) - done[b]) if done[b] < len(prompts[b]) else 1
            chunks.append(SequenceChunk(tuple(streams[b][done[b] : done[b] + n]), done[b], blocks[b], state_slot=slots[b]))
        logits = model(chunks).float().cpu()
        for row, (b, chunk) in enumerate(zip(batch, chunks)):
            _compare(result, logits[row], ref_logits[b][chunk.end - 1], streams[b], chunk.end, len(prompts[b]))
            done[b] = chunk.end


def _compare(result: CheckResult, got: torch.Tensor, want: torch.Tensor, stream, end: int, prompt_len: int) -> None:
    abs_err = (got - want).abs().max().item()
    rel_err = abs_err / max(want.abs().max().item(), 1e-6)
    result.max_abs_err = max(result.max_abs_err, abs_err)
    result.max_rel_err = max(result.max_rel_err, rel_err)
    result.rows_compared += 1
    if end >= prompt_len:  # this row predicts a generated token
        result.tokens_compared += 1
        result.tokens_agreed += int(int(got.argmax()) == stream[end])
