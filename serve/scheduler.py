"""The scheduler: which sequences run in the next step, and how many of their tokens.

Each step fills a budget of ``max_num_tokens`` tokens and ``max_batch_size`` sequences, of which at
most ``max_num_prefill_tokens`` are prompt tokens (the latency policy: a step that prefills a long
prompt while others decode costs every decoding client that step's time between two tokens, so the
prompt is cut into chunks that keep such steps short). Once at least half of ``max_batch_size``
sequences decode in a step, ``busy_prefill_tokens`` (if set) caps its prompt tokens instead: next to
that many decodes a small chunk rides on the weight stream the decodes pay for anyway, where a large one
turns the step compute-bound; while the batch fills, prompts keep the larger budget (time to first token).

1. Decodes first: every running sequence with one token to run, oldest first. So no prompt, however
   long, ever takes a decoding sequence's place in a step.
2. Then the running sequences still prefilling, oldest first: the next chunk of each prompt
   (chunked prefill), within the prefill budget.
3. Then waiting sequences, first come first served, as long as both budgets and free blocks allow.
   A sequence starting (or restarting) takes the longest cached prefix of its tokens from the
   block manager first and only runs the rest.

If the KV blocks run out, the newest running sequence not yet in this step is preempted: its blocks
are freed and it goes back to the front of the waiting queue to be recomputed later (its generated
tokens are kept).

A model with recurrent or convolution state (see ``kvcache/state_pool.py``) needs a state slot per
running sequence: admission takes one from the block manager with the blocks, and every release
(finish, abort, preemption) gives it back. A preempted sequence restarts from its first token, so
its state is rebuilt by prefilling again, like its KV blocks.

Nothing here touches the device; the engine turns a :class:`Schedule` into model inputs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from autodeploy.kvcache.block_manager import BlockManager, blocks_needed

from .sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledChunk:
    """Run ``num_tokens`` tokens of ``seq`` from position ``seq.num_computed``."""

    seq: Sequence
    start: int
    num_tokens: int
    num_logits: int  # logits rows wanted: 1, or every position while collecting prompt logprobs

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so its last logits row picks a new token."""
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class Schedule:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_tokens: int,
                 max_num_prefill_tokens: int | None = None, busy_prefill_tokens: int | None = None):
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        # None: prompts may take the whole token budget
        self.max_num_prefill_tokens = min(max_num_prefill_tokens or max_num_tokens, max_num_tokens)
        # None: no smaller budget while the batch is busy decoding
        self.busy_prefill_tokens = min(busy_prefill_tokens or self.max_num_prefill_tokens, self.max_num_prefill_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Schedule:
        step = _StepBuilder(self.max_num_tokens, self.max_num_prefill_tokens, self.max_batch_size)
        for seq in [s for s in self.running if s.num_uncomputed == 1 and not s.awaits_last_token]:
            if step.full:
                break
            if seq.status is Status.RUNNING and self._grow_or_preempt(seq, 1, step):
                step.add(_chunk(seq, 1), prefill=False)
        if 2 * len(step.chunks) >= self.max_batch_size:  # the batch is busy decoding
            step.prefill_tokens = min(step.prefill_tokens, self.busy_prefill_tokens)
        for seq in [s for s in self.running if s.num_uncomputed > 1]:
            if step.full or not step.prefill_budget:
                break
            n = min(seq.num_uncomputed, step.prefill_budget)
            if seq.status is Status.RUNNING and self._grow_or_preempt(seq, n, step):
                step.add(_chunk(seq, n), prefill=True)
        # Admitting new work right after a preemption would only thrash the cache.
        while self.waiting and not step.full and step.prefill_budget and not step.preempted:
            chunk = self._admit(self.waiting[0], step.prefill_budget)
            if chunk is None:
                break
            self.waiting.popleft()
            step.add(chunk, prefill=True)
        return Schedule(tuple(step.chunks), tuple(step.preempted))

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _grow_or_preempt(self, seq: Sequence, n: int, step: _StepBuilder) -> bool:
        """Blocks for ``n`` more tokens of ``seq``, preempting the newest running sequences not in this
        step while they are short; False if ``seq`` cannot run now (it may have been preempted itself)."""
        need = blocks_needed(seq.num_computed + n, self.blocks.block_size) - len(seq.block_ids)
        if need <= 0:  # most decodes: the last block has room
            return True
        while need > self.blocks.num_free:
            victim = next((s for s in reversed(self.running) if s not in step.scheduled), None)
            if victim is None:
                return False
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_ids.extend(self.blocks.allocate(need))
        return True

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        match = None
        if seq.num_computed == 0 and not seq.wants_prompt_logprobs:
            # Reuse cached blocks, but always leave the last token to run: its logits are needed.
            match = self.blocks.match_prefix(seq.token_ids, (seq.num_tokens - 1) // self.blocks.block_size)
            seq.block_ids, seq.block_keys = list(match.block_ids), list(match.keys)
            seq.num_computed = match.num_tokens
        n = min(seq.num_uncomputed, budget)
        need = blocks_needed(seq.num_computed + n, self.blocks.block_size) - len(seq.block_ids)
        if need > self.blocks.num_free or not self._has_state_slot_for(seq):
            self._release(seq)  # give the matched blocks back; they stay cached
            return None
        if match is not None:
            self.blocks.count_lookup(seq.num_tokens, match)
            if seq.first_scheduled_time is None:
                seq.num_cached_tokens = match.num_tokens
        seq.block_ids.extend(self.blocks.allocate(need))
        if self.blocks.num_state_slots:
            seq.state_slot = self.blocks.allocate_state_slot()
        seq.status = Status.RUNNING
        seq.first_scheduled_time = seq.first_scheduled_time or time.monotonic()
        self.running.append(seq)
        return _chunk(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_ids)
        seq.block_ids, seq.block_keys = [], []
        seq.num_computed = 0
        if seq.state_slot >= 0:
            self.blocks.free_state_slot(seq.state_slot)
            seq.state_slot = -1

    def _has_state_slot_for(self, seq: Sequence) -> bool:
        return not self.blocks.num_state_slots or seq.state_slot >= 0 or self.blocks.num_free_state_slots > 0


class _StepBuilder:
    """The chunks of one step so far and what is left of its budgets."""

    def __init__(self, tokens: int, prefill_tokens: int, seqs: int):
        self.tokens, self.prefill_tokens, self.seqs = tokens, prefill_tokens, seqs
        self.chunks: list[ScheduledChunk] = []
        self.scheduled: set[Sequence] = set()
        self.preempted: list[Sequence] = []

    @property
    def full(self) -> bool:
        return self.tokens <= 0 or len(self.chunks) >= self.seqs

    @property
    def prefill_budget(self) -> int:
        return max(0, min(self.tokens, self.prefill_tokens))

    def add(self, chunk: ScheduledChunk, prefill: bool) -> None:
        self.chunks.append(chunk)
        self.scheduled.add(chunk.seq)
        self.tokens -= chunk.num_tokens
        if prefill:
            self.prefill_tokens -= chunk.num_tokens


def _chunk(seq: Sequence, n: int) -> ScheduledChunk:
    return ScheduledChunk(seq, seq.num_computed, n, n if seq.wants_prompt_logprobs else 1)
