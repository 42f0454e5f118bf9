"""Whole-step graphs of prefill and mixed steps on the CPU: each captured shape is called where its
graph would replay (``DirectStepGraph``: the static inputs the refill wrote, its results written into
the captured outputs), so bucketing, padding of tokens and sequences, the shared metadata buffer and
the dispatch in ``CompiledModel.__call__`` run as they do on a GPU.

The reference of a whole-step graph's step is the compiled graph run eagerly on the same padded step
(same ops, same shapes: equal bit for bit, logits and KV pool), and on the unpadded step (close)."""

import copy

import pytest
import torch

import autodeploy
from autodeploy.cudagraph import counting_captures
from autodeploy.kernels.attention_config import DECODE_TOKENS_PER_SEQ
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.mixed_graphs import MixedGraphRunner, sequence_buckets
from autodeploy.tiny import make_tiny_checkpoint
from graph_pass import apply_cuda_graph_pass

SIZES = [4, 16, 32]
GRAPHS = {"piecewise": True, "piecewise_on_cpu": True, "mixed_graphs": True, "mixed_graphs_on_cpu": True, "piecewise_sizes": SIZES}
CPU = dict(device="cpu", dtype="float32", max_seq_len=64, max_batch_size=8, max_num_tokens=64, num_kv_blocks=40)
SHAPES = [(4, 3), (16, 3), (16, 8), (32, 7), (32, 8)]  # (tokens, sequences) of SIZES at 8 sequences


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
            with counting_captures() as captures:
                cache[arch] = autodeploy.compile(path, passes={"compile_cuda_graphs": GRAPHS}, **CPU)
            cache[arch].captures_at_compile, cache[arch].path = list(captures), path
        return cache[arch]

    return get


@pytest.fixture
def replays(monkeypatch):
    """The shapes whole-step graphs replayed, in order."""
    seen, run = [], MixedGraphRunner.run

    def spy(self, chunks, pad, *args):
        seen.append((pad.num_tokens, pad.num_seqs))
        return run(self, chunks, pad, *args)

    monkeypatch.setattr(MixedGraphRunner, "run", spy)
    return seen


def _pools(model) -> list[torch.Tensor]:
    return list(model.pool.caches)


def _eager(model, batch: BatchMetadata) -> torch.Tensor:
    with torch.inference_mode():
        return model.gm(**batch.as_kwargs(), **model.pool.as_kwargs())


def _ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


MIXES = {  # name -> chunks (blocks of 16 slots), the shape expected
    "decodes and a chunk": ([SequenceChunk(_ids(1, i), 20 + i, (1 + 2 * i, 2 + 2 * i)) for i in range(4)]
                            + [SequenceChunk(_ids(9, 9), 0, (20,))], (16, 8)),
    "prefill only": ([SequenceChunk(_ids(30, 1), 0, (21, 22))], (32, 7)),
    "two prompts, padded tokens and sequences": ([SequenceChunk(_ids(5, 2), 0, (23,)),
                                                  SequenceChunk(_ids(7, 3), 0, (24,))], (16, 3)),
    "a chunk continuing a cached prefix": ([SequenceChunk(_ids(10, 4), 14, (25, 26)),
                                           SequenceChunk(_ids(1, 5), 40, (27, 28, 29))], (16, 3)),
    "decodes only, past the decode graphs": ([SequenceChunk(_ids(1, 10 + i), 5, (30 + i,)) for i in range(3)], (4, 3)),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_whole_step_graphs_equal_the_eager_graph(compiled, replays, mix):
    model = compiled("llama")
    chunks, shape = MIXES[mix]
    generator = torch.Generator().manual_seed(0)
    for cache in _pools(model):
        cache.normal_(generator=generator)  # the cached prefixes hold keys and values
    before = [c.clone() for c in _pools(model)]
    logits = model(chunks).clone()
    after = [c.clone() for c in _pools(model)]
    assert replays == [shape] and logits.shape == (len(chunks), model.vocab_size)
    pad = model.mixed_graphs.padding(chunks)
    for batch, exact in ((BatchMetadata.build(chunks, model.block_size, "cpu", pad=pad), True),
                         (BatchMetadata.build(chunks, model.block_size, "cpu"), False)):
        for cache, saved in zip(_pools(model), before):
            cache.copy_(saved)
        want = _eager(model, batch)[: len(chunks)]
        if exact:
            assert torch.equal(logits, want)
            assert all(torch.equal(c, a) for c, a in zip(_pools(model), after))
        else:
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_sequence_buckets_keep_the_attention_launch_of_the_real_step():
    """Padding a step's sequences to its bucket leaves ``AttentionLaunch.choose``'s decode/prefill
    choice where the step itself (at its token bucket) has it."""
    assert sequence_buckets(128, 64) == [31, 64] and sequence_buckets(2048, 256) == [256]
    assert sequence_buckets(4, 64) == [3] and sequence_buckets(1, 64) == [] and sequence_buckets(128, 200) == [31, 127]
    decode = lambda tokens, seqs: tokens <= DECODE_TOKENS_PER_SEQ * seqs  # noqa: E731 (choose's test)
    for max_seqs in (1, 8, 64, 256):
        for tokens in (1, 2, 3, 4, 8, 16, 24, 96, 128, 256, 1024, 2048):
            buckets = sequence_buckets(tokens, max_seqs)
            for seqs in range(1, min(tokens - 1, max_seqs) + 1):  # a step with more tokens than sequences
                padded = next(b for b in buckets if b >= seqs)
                assert decode(tokens, padded) == decode(tokens, seqs), (tokens, max_seqs, seqs)


def test_steps_a_whole_step_graph_cannot_take_run_piecewise_or_eagerly(compiled, replays):
    model = compiled("llama")
    several_logits = [SequenceChunk(_ids(6, 1), 0, (1,), num_logits=3)]
    too_many_tokens = [SequenceChunk(_ids(33, 2), 0, (2, 3, 4))]
    decodes_filling_the_bucket = [SequenceChunk(_ids(1, i), 3, (5 + i,)) for i in range(4)]  # logits gather: identity
    for chunks in (several_logits, decodes_filling_the_bucket):
        assert model.mixed_graphs.padding(chunks) is None and model.piecewise.padding(chunks) is not None
        assert model(chunks).shape == (sum(c.num_logits for c in chunks), model.vocab_size)
    assert model.mixed_graphs.padding(too_many_tokens) is None and model.piecewise.padding(too_many_tokens) is None
    assert model(too_many_tokens).shape[0] == 1
    assert replays == []


def test_captures_happen_at_compile_time_only(compiled, replays):
    model = compiled("llama")
    runner = model.mixed_graphs
    assert [(p.num_tokens, p.num_seqs) for p in runner.shapes] == SHAPES and sorted(runner.graphs) == SHAPES
    whole = [c for c in model.captures_at_compile if c.startswith("the whole step")]
    assert len(model.captures_at_compile) == model.piecewise.num_captures + len(SHAPES)
    assert whole[0] == "the whole step of 32 tokens and 8 sequences"  # largest first
    with counting_captures() as captures:
        for chunks, _ in MIXES.values():
            model(chunks)
    assert captures == [] and len(replays) == len(MIXES)


def test_the_start_up_report_says_what_was_captured(compiled):
    table = compiled("llama").report.pass_table()
    assert ("whole-step graphs: 5 shapes over 3 token buckets (4-32 tokens, up to 8 sequences) captured in" in table
            and "metadata buffers" in table)


def test_canary_and_the_async_engine_run_through_whole_step_graphs(compiled, replays):
    """The canary (prefill, chunked prefill, decodes against HF eager) and the engine with async
    scheduling (input ids written on the device into the shared metadata buffer) against without it."""
    from autodeploy.check import run_check
    from autodeploy.sampling_params import SamplingParams
    from autodeploy.serve.engine import Engine, EngineConfig

    model = compiled("llama")
    result = run_check(model.path, steps=4, prompt_lens=(3, 9, 21), chunk_size=8, compiled=model)
    assert result.passed, result.summary()
    assert any(seqs > 1 for _, seqs in replays)
    prompts = [list(_ids(n, n)) for n in (3, 11, 6, 20)]
    tokens = {}
    for overlap in (False, True):
        engine = Engine(model, None, EngineConfig(overlap=overlap, max_num_tokens=16))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids if o.outputs else ())
        tokens[overlap] = out
    assert tokens[True] == tokens[False] and all(len(t) == 5 for t in tokens[True].values())


def _apply_pass(model, properties=("state_is_kv_only",), **config):
    return apply_cuda_graph_pass(model, {"mixed_graphs": True, "mixed_graphs_on_cpu": True} | config, "mixed_graphs", properties)


def test_whole_step_graphs_are_a_switch_and_refused_where_they_cannot_hold(compiled):
    model = compiled("llama")
    runner, detail = _apply_pass(model, piecewise_sizes=[8])
    assert runner.graphs.keys() == {(8, 1), (8, 7)} and "piecewise graphs: not on CUDA" in detail
    runner, detail = _apply_pass(model, piecewise_sizes=[1])
    assert runner is None and "whole-step graphs: no token bucket of more than one token asked for" in detail
    runner, detail = _apply_pass(model, mixed_graphs=False)
    assert runner is None and "whole-step graphs: off (passes.compile_cuda_graphs.mixed_graphs=false)" in detail
    runner, detail = _apply_pass(model, properties=())
    assert runner is None and "check_uncached_state did not prove" in detail
    from types import SimpleNamespace

    from autodeploy.passes.compile_cuda_graphs import _uncapturable

    for backend in ("torch", "flashinfer"):  # on CUDA: they synchronize with the host
        ctx = SimpleNamespace(gm=model.gm, device=torch.device("cuda"), artifacts={"attention_backend": backend})
        assert _uncapturable(ctx, capturable=()) == f"attention backend '{backend}' cannot be captured"


@pytest.mark.parametrize("op, why", [("ssm_scan_cached", "loops over the step's sequences on the host"),
                                     ("moe", "reads the routed expert ids on the host")])
def test_host_syncing_ops_leave_prefill_and_mixed_steps_piecewise(compiled, op, why):
    """A hybrid's state ops loop over a prefill step's sequences on the host (their decode steps do not:
    decode graphs take them); MoE's reference routing reads expert ids on the host on every step. A
    node calling the op in the graph (never run: the pass refuses before any capture)."""
    from autodeploy.passes.compile_cuda_graphs import _host_sync

    model = copy.copy(compiled("llama"))
    model.gm = copy.deepcopy(model.gm)
    first = next(iter(model.gm.graph.find_nodes(op="placeholder")))
    with model.gm.graph.inserting_after(first):
        model.gm.graph.call_function(getattr(torch.ops.autodeploy, op).default, (first,))
    runner, detail = _apply_pass(model)
    assert runner is None and f"whole-step graphs skipped: autodeploy.{op}.default {why}" in detail
    decode_graphs_refuse = _host_sync(model)
    assert (decode_graphs_refuse is None) == (op == "ssm_scan_cached")
