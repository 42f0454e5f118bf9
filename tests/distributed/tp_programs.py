"""Programs the tensor-parallel tests run on every rank (spawned processes import this module).

``greedy_run`` drives a compiled model the way the engine does, without the engine: prompts of
different lengths prefilled in chunks next to other sequences' decodes, greedy tokens fed back.
"""

from __future__ import annotations

import numpy as np
import torch

from autodeploy.compiler import compile as compile_model
from autodeploy.distributed import current, init_tensor_parallel
from autodeploy.distributed_launch import run_on_ranks
from autodeploy.distributed_steps import StepPublisher, follow_steps
from autodeploy.kvcache.allocator import BlockAllocator, blocks_needed
from autodeploy.kvcache.metadata import SequenceChunk
from autodeploy.testing import reusing_exports

OPTIONS = {"dtype": "float32", "device": "cpu", "max_seq_len": 64, "max_batch_size": 4, "max_num_tokens": 64}
PROMPT_LENS = (5, 19, 11)


def _import_what_a_compile_imports() -> None:
    """The modules a process's first export and pass pipeline import (1-2 s): imported with this module,
    once in the fork server (``run_tp``) rather than in every rank forked from it."""
    import torch._functorch.aot_autograd  # noqa: F401
    import torch.export._trace  # noqa: F401

    from autodeploy.pipeline import load_pipeline

    load_pipeline()


_import_what_a_compile_imports()


def prompts(vocab_size: int = 128, lens=PROMPT_LENS) -> list[list[int]]:
    """Token ids inside every tiny vocabulary (the committed quantized fixtures have 128 tokens)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


def greedy_run(model, prompt_ids: list[list[int]], steps: int, chunk_size: int = 8):
    """Every step's logits (as arrays) and each sequence's tokens after ``steps`` greedy tokens."""
    allocator = BlockAllocator(model.num_blocks)
    tokens = [list(p) for p in prompt_ids]
    blocks = [tuple(allocator.allocate(blocks_needed(len(p) + steps, model.block_size))) for p in prompt_ids]
    done, generated, rows = [0] * len(tokens), [0] * len(tokens), []
    while any(g < steps for g in generated):
        active = [i for i in range(len(tokens)) if generated[i] < steps]
        chunks = [SequenceChunk(tuple(tokens[i][done[i]: done[i] + chunk_size]), done[i], blocks[i]) for i in active]
        logits = model(chunks).float()
        for row, (i, chunk) in enumerate(zip(active, chunks)):
            done[i] = chunk.end
            if done[i] == len(tokens[i]):
                tokens[i].append(int(logits[row].argmax()))
                generated[i] += 1
        rows.append(logits.numpy().copy())
    return rows, tokens


def run_tp(world: int, runs: dict[str, tuple[str, dict]], steps: int | dict[str, int]) -> list:
    """``tp_greedy`` on ``world`` ranks; every rank's result. The ranks fork from a server process that
    imported this module once for all of a pytest worker's jobs (each spawned rank took ~7 s of CPU
    importing torch, transformers and the compiler)."""
    return run_on_ranks(world, tp_greedy, world, runs, steps, start_method="forkserver")


def tp_greedy(rank: int, store, world: int, runs: dict[str, tuple[str, dict]], steps: int | dict[str, int]):
    """Check the collective ops, then compile each ``(checkpoint, options)`` over the job and run
    ``greedy_run`` from rank 0 while the others follow its steps (``steps``: for every run, or by
    run name). Rank 0 returns everything."""
    job = init_tensor_parallel(world, rank, store=store, device="cpu")
    out = {"collectives": collective_results(rank, world)}
    with reusing_exports():  # (runs of one checkpoint differ after the export: sharding, weights, KV dtype)
        for name, (path, options) in runs.items():
            model = compile_model(path, tp_size=world, **OPTIONS, **options)
            if job.is_driver:
                model.publisher = StepPublisher(current())
                out[name] = greedy_run(model, prompts(), _steps(steps, name))
                out[f"{name}: steps by kind"] = dict(model.publisher.kinds)
                model.publisher.stop()
            else:
                follow_steps(model, job)
    return out if job.is_driver else out["collectives"]


def _steps(steps: int | dict[str, int], name: str) -> int:
    return steps[name] if isinstance(steps, dict) else steps


def collective_results(rank: int, world: int) -> dict[str, list]:
    """The collective ops on values that differ per rank (the test knows what each must give)."""
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    reduced = torch.ops.autodeploy.all_reduce(x, current().group_name)
    gathered = torch.ops.autodeploy.all_gather(x, -1, current().group_name)
    return {"all_reduce": reduced.tolist(), "all_gather": gathered.tolist(), "input": x.tolist()}


def references(runs: dict[str, tuple[str, dict]], steps: int | dict[str, int]) -> dict[str, tuple]:
    """``greedy_run`` of each run's single-process compiled model, by run name."""
    with reusing_exports():
        return {name: greedy_run(compile_model(path, **OPTIONS, **options), prompts(), _steps(steps, name))
                for name, (path, options) in runs.items()}


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))
