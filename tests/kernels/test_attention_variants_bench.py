"""bench/attention_variants_gpu.py imports without a GPU, and what it checks the kernel against (its
``reference``, every variant's features) agrees with the kernel on a small step (interpreter, fp32)."""

import sys
from pathlib import Path

import pytest
import torch

from paged_batches import random_cache, shuffled_blocks, step_metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import attention_variants_gpu as bench  # noqa: E402


@pytest.mark.parametrize("name", list(bench.VARIANTS))
def test_the_benchmarks_reference_agrees_with_the_kernel(name):
    seqs = [(5, 3), (0, 4), (9, 1)]
    blocks = shuffled_blocks([c + n for c, n in seqs], 4, num_blocks=16)
    query_lens, context_lens, cu, table, slots = step_metadata([(c, n, b) for (c, n), b in zip(seqs, blocks)], 4)
    q, k, v = (torch.randn(slots.shape[0], h, 16) for h in (bench.kg.HQ, bench.kg.HKV, bench.kg.HKV))
    batch = bench.kg.PagedBatch(q, k, v, random_cache(16, 4, bench.kg.HKV, 16, torch.float32), query_lens,
                                context_lens, cu, table, slots)
    features = bench.VARIANTS[name]
    want = bench.reference(batch, batch.cache.clone(), **features)
    torch.testing.assert_close(batch.triton(cache=batch.cache.clone(), **features), want, atol=1e-5, rtol=1e-5)
