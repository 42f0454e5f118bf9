"""The KV sizing pass profiles the largest step the scheduler can build, not one sequence of it, and
leaves the compiles of that step to the warm-up's thread pool where that is safe."""

import operator
import types

import pytest
import torch
import triton

import autodeploy.ops  # noqa: F401  (registers autodeploy::moe)
from autodeploy.kvcache.metadata import BatchMetadata
from passes.allocate_kv_cache import _deferred_compiles, _value_dependent, profiling_chunks


def test_profiling_step_spans_max_num_tokens_in_sequences_of_max_seq_len():
    chunks, n_blocks = profiling_chunks(max_num_tokens=40, max_seq_len=16, max_batch_size=8, block_size=4)
    assert [len(c.token_ids) for c in chunks] == [16, 16, 8]
    assert all(c.context_len == 0 for c in chunks)
    blocks = [b for c in chunks for b in c.block_ids]
    assert blocks == list(range(1, n_blocks + 1)) and n_blocks == 4 + 4 + 2  # distinct, block 0 left alone
    batch = BatchMetadata.build(chunks, 4, "cpu")
    assert batch.input_ids.numel() == 40


def test_profiling_step_respects_the_batch_limit():
    chunks, n_blocks = profiling_chunks(max_num_tokens=8192, max_seq_len=1024, max_batch_size=2, block_size=16)
    assert [len(c.token_ids) for c in chunks] == [1024, 1024] and n_blocks == 128
    one, _ = profiling_chunks(max_num_tokens=100, max_seq_len=1024, max_batch_size=4, block_size=16)
    assert [len(c.token_ids) for c in one] == [100]


def _graph(op):
    """A graph module calling ``op`` on its input."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(op, (x,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_value_dependent_ops_are_found_by_their_schema():
    assert not _value_dependent(_graph(torch.ops.aten.relu.default))
    assert _value_dependent(_graph(torch.ops.aten.nonzero.default))
    moe = torch.fx.Graph()
    x, ids, weights, w1, w2 = (moe.placeholder(n) for n in ("x", "ids", "weights", "w1", "w2"))
    moe.output(moe.call_function(torch.ops.autodeploy.moe.default, (x, ids, weights, w1, w2)))
    assert _value_dependent(torch.fx.GraphModule(torch.nn.Module(), moe))
    assert not _value_dependent(_graph(operator.neg))  # plain Python targets have no schema


@pytest.mark.parametrize("threads, op, defers", [(4, torch.ops.aten.relu.default, True),
                                                 (1, torch.ops.aten.relu.default, False),
                                                 (4, torch.ops.aten.nonzero.default, False)])
def test_the_sizing_step_records_its_compiles_only_where_a_thread_pool_takes_them(monkeypatch, threads, op,
                                                                                   defers):
    """Where kernels compile on threads and the step's memory does not depend on values, the sizing step's
    launches that would compile are recorded and skipped (Triton's JIT hook is set inside); else the step
    runs as is."""
    from autodeploy.kernels import precompile

    monkeypatch.setattr(precompile, "threads_for", lambda device, configured=None: threads)
    ctx = types.SimpleNamespace(gm=_graph(op), device=torch.device("cuda", 0))
    before = triton.knobs.runtime.jit_cache_hook
    with _deferred_compiles(ctx) as pending:
        hooked = triton.knobs.runtime.jit_cache_hook is not before
        assert pending == []
    assert hooked == defers and triton.knobs.runtime.jit_cache_hook is before


class _FakeMemory:
    """torch.cuda's memory counters for a profiling step on the CPU: each forward allocates ``step``."""

    def __init__(self, monkeypatch, step: int):
        self.allocated, self.peak, self.step = 100, 100, step
        for name, fn in (("synchronize", lambda device=None: None),
                         ("reset_peak_memory_stats",
                          lambda device=None: setattr(self, "peak", self.allocated)),
                         ("memory_allocated", lambda device=None: self.allocated),
                         ("max_memory_allocated", lambda device=None: self.peak)):
            monkeypatch.setattr(torch.cuda, name, fn)

    def forward(self):
        self.peak = max(self.peak, self.allocated + self.step)


@pytest.mark.parametrize("fails_deferred", [False, True])
def test_a_sizing_step_that_fails_with_skipped_kernels_runs_again_for_real(monkeypatch, caplog,
                                                                           fails_deferred):
    from autodeploy.kernels import precompile
    from passes.allocate_kv_cache import AllocateKVCache

    monkeypatch.setattr(precompile, "threads_for", lambda device, configured=None: 4)
    memory = _FakeMemory(monkeypatch, step=7)
    ctx = types.SimpleNamespace(gm=_graph(torch.ops.aten.relu.default), device=torch.device("cuda", 0),
                                artifacts={})
    calls = []

    def forward():
        hooked = triton.knobs.runtime.jit_cache_hook is not None
        calls.append(hooked)
        if hooked:  # as if a skipped launch was recorded, then an op rejected the garbage it left
            spec = {"key": "k", "specialization_data": "{}", "device": 0}
            triton.knobs.runtime.jit_cache_hook(fn=types.SimpleNamespace(jit_function=forward), compile=spec)
            if fails_deferred:
                raise IndexError("index out of range in self")
        memory.forward()

    assert AllocateKVCache(AllocateKVCache.Config())._profile(ctx, forward) == 7
    assert calls == ([True, False] if fails_deferred else [True])
    assert ("pending_kernels" in ctx.artifacts) != fails_deferred
    assert ("running it for real" in caplog.text) == fails_deferred


def test_a_pool_is_capped_where_a_layer_would_pass_32_bit_offsets():
    from autodeploy.kvcache.pool import MAX_ELEMENTS_PER_LAYER, KVCacheSpec, KVPool
    from passes.allocate_kv_cache import _addressable

    smollm2 = [KVCacheSpec(num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)] * 30
    per_block = 2 * 16 * 3 * 64
    limit = KVPool.max_addressable_blocks(smollm2, 16)
    assert limit == MAX_ELEMENTS_PER_LAYER // per_block and (limit + 1) * per_block > 2**31 - 1
    assert _addressable(1000, smollm2, 16, explicit=False) == 1000  # (zero-match: below the limit, untouched)
    assert _addressable(10 * limit, smollm2, 16, explicit=False) == limit  # an H200's free memory would pass it
    with pytest.raises(RuntimeError, match="32-bit offsets; at most"):
        _addressable(limit + 1, smollm2, 16, explicit=True)
    mla = [KVCacheSpec.latent(512, 64, torch.bfloat16)]  # one entry of 576 values per token
    assert KVPool.max_addressable_blocks(mla + smollm2, 16) == MAX_ELEMENTS_PER_LAYER // (16 * 576)
