"""Piecewise CUDA graphs on the CPU: every captured piece is called where its graph would replay
(``DirectStepGraph``: the inputs it was captured with, its results written into the captured
outputs), so the splitting, bucketing, padding and eager interleaving run as they do on a GPU.

The reference of a piecewise step is the compiled graph run eagerly on the same padded step: the
same ops on the same shapes, so equal bit for bit (logits and the whole KV pool). Against the
unpadded step only a kernel's choice for another row count may move the last bits."""

import copy
from pathlib import Path

import pytest
import torch

import autodeploy
from autodeploy.cudagraph import CaptureError, counting_captures
from autodeploy.distributed_steps import batch_from_flat
from autodeploy.graph.split import split_at_eager_ops
from autodeploy.kvcache.allocator import BlockAllocator, blocks_needed
from autodeploy.kvcache.metadata import GRAPH_INPUTS, BatchMetadata, SequenceChunk
from autodeploy.piecewise import PiecewiseRunner, default_piecewise_sizes
from autodeploy.tiny import make_tiny_checkpoint
from graph_pass import apply_cuda_graph_pass

SIZES = [4, 16, 32]
PIECEWISE = {"compile_cuda_graphs": {"piecewise": True, "piecewise_on_cpu": True, "piecewise_sizes": SIZES}}
CPU = dict(device="cpu", dtype="float32", max_seq_len=64, max_batch_size=8, max_num_tokens=64)
QUANT_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "quant" / "llama_ct_fp8_dynamic"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Models compiled with piecewise graphs on the CPU, each once per module."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = QUANT_FIXTURE if arch == "quantized" else make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
            with counting_captures() as captures:
                cache[arch] = autodeploy.compile(path, passes=PIECEWISE, **CPU)
            cache[arch].captures_at_compile, cache[arch].path = list(captures), path
        return cache[arch]

    return get


def _streams(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (25, 12, 30)]


def _steps(model, prompts: list[list[int]], decode_steps: int = 2, chunk: int = 10):
    """The engine's kind of steps: staggered joins, chunked prefills next to decodes; yields the
    chunks and takes back the step's logits (greedy tokens are fed back)."""
    allocator = BlockAllocator(model.num_blocks)
    tokens = [list(p) for p in prompts]
    blocks = [tuple(allocator.allocate(blocks_needed(len(p) + decode_steps, model.block_size))) for p in prompts]
    done, step = [0] * len(prompts), 0
    while any(d < len(p) + decode_steps - 1 for d, p in zip(done, prompts)):
        active = [i for i in range(len(prompts)) if step >= i and done[i] < len(prompts[i]) + decode_steps - 1]
        step += 1
        slot = (lambda i: i) if model.num_state_slots else (lambda i: -1)  # a state model: a state slot each
        chunks = [SequenceChunk(tuple(tokens[i][done[i]: done[i] + chunk]), done[i], blocks[i], state_slot=slot(i))
                  for i in active]
        logits = yield chunks
        for row, (i, c) in enumerate(zip(active, chunks)):
            done[i] = c.end
            if done[i] == len(tokens[i]):
                tokens[i].append(int(logits[row].argmax()))


def _eager(model, batch: BatchMetadata) -> torch.Tensor:
    with torch.inference_mode():
        return model.gm(**batch.as_kwargs(), **model.pool.as_kwargs())


def _pool_tensors(model) -> list[torch.Tensor]:
    """The KV caches and, for a model with state, the state pool's tensors."""
    return [*model.pool.caches, *(model.pool.state.states if model.pool.state is not None else ())]


def _run_compared(model, chunks):
    """The piecewise step, checked against the eager graph on the padded and on the unpadded step
    (each from the same cache and state); returns the piecewise logits, the pools left as it leaves them."""
    caches = [c.clone() for c in _pool_tensors(model)]
    logits = model(chunks).clone()
    after = [c.clone() for c in _pool_tensors(model)]
    runner = model.piecewise
    for batch, exact in ((runner.prepare(chunks, runner.padding(chunks)), True),
                         (BatchMetadata.build(chunks, model.block_size, "cpu"), False)):
        for cache, saved in zip(_pool_tensors(model), caches):
            cache.copy_(saved)
        want = _eager(model, batch)
        if exact:
            assert torch.equal(logits, want)
            assert all(torch.equal(c, a) for c, a in zip(_pool_tensors(model), after))
        else:
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))
    for cache, saved in zip(_pool_tensors(model), after):
        cache.copy_(saved)
    return logits


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_moe", "gpt_neox", "quantized", "nemotron_h"])
def test_piecewise_steps_equal_the_eager_graph_bit_for_bit(compiled, arch):
    """gemma2: sliding window of 8 and softcaps; qwen3_moe: MoE run eagerly between pieces, q/k norms;
    gpt_neox: partial rotary, parallel residual, biases; quantized: compressed-tensors FP8 (dynamic
    per-token activations); nemotron_h: a Mamba-2 hybrid, its state ops eager between pieces (the
    state pool compared too)."""
    model = compiled(arch)
    assert model.piecewise is not None and model.piecewise.sizes == SIZES
    steps = _steps(model, _streams(model.vocab_size))
    chunks, buckets = next(steps), set()
    try:
        while True:
            buckets.add(model.piecewise.padding(chunks).num_tokens)
            chunks = steps.send(_run_compared(model, chunks))
    except StopIteration:
        pass
    assert buckets == set(SIZES)  # decodes alone, mixed steps, the three prompts' chunks together


def test_the_graph_splits_at_attention_and_the_logits_gather(compiled):
    split = split_at_eager_ops(compiled("llama").gm)
    assert len(split.captured) == 3 and len(split.eager) == 3  # 2 layers: before, between, after attention
    reasons = list(split.reasons.values())
    assert all("paged_attention reads the step's kv_cache_" in r for r in reasons[:2])
    assert reasons[2] == "gather_rows reads the step's logits_indices"  # and the LM head after it, by size
    assert list(split.fresh_args.values()) == [(), (0,), (0,)]  # each attention output, copied into a slot


def test_moe_runs_eagerly_between_pieces_and_decode_graphs_name_it(compiled):
    from autodeploy.passes.compile_cuda_graphs import _host_sync

    model = compiled("qwen3_moe")
    reasons = model.piecewise.split.reasons.values()
    assert sum("moe reads the routed expert ids on the host" in r for r in reasons) == 2
    ctx = type("Ctx", (), {"gm": model.gm})
    assert _host_sync(ctx).startswith("autodeploy.moe.default (model.layers.0.mlp")


def test_state_ops_run_eagerly_between_pieces_and_decode_graphs_take_them(compiled):
    """The state ops loop over a prefill step's sequences on the host: never inside a captured piece;
    their decode steps do not (``ops/state_decode.py``), so they no longer stop decode graphs."""
    from autodeploy.passes.compile_cuda_graphs import _host_sync

    model = compiled("nemotron_h")
    split = model.piecewise.split
    for op in ("causal_conv1d_cached", "ssm_scan_cached"):
        assert sum(f"{op} loops over the step's sequences on the host" in r for r in split.reasons.values()) == 1
    captured = [getattr(split.outer, name).module for name in split.captured]  # (each wrapped as a _Piece)
    targets = {str(n.target) for piece in captured for n in piece.graph.nodes}
    assert any(t.startswith("aten.") for t in targets)  # (the pieces do hold the rest)
    assert not any(t.startswith("autodeploy.") and "_cached" in t for t in targets)
    assert _host_sync(type("Ctx", (), {"gm": model.gm})) is None


@pytest.mark.parametrize("arch", ["nemotron_h", "minimax"])
def test_hybrid_decode_steps_through_the_decode_graph_path_pass_the_canary(compiled, monkeypatch, arch):
    """The decode-graph path of ``autodeploy.cudagraph`` with the CPU stand-in of a capture (a replay
    runs the graph module again on the static inputs ``CudaGraphRunner.run`` refilled, padded to the
    captured size: padding sequences have slot -1 and no tokens): the decode steps of a Mamba-2 hybrid and
    of MiniMax's lightning attention at sizes 1 and 4 (three sequences: a padding row), through the state
    ops' batched decode form."""
    from autodeploy.check import run_check
    from autodeploy.cudagraph import CudaGraphRunner, DirectStepGraph, _Captured
    from autodeploy.ops import state_decode

    model = compiled(arch)
    runner = CudaGraphRunner(model.gm, model.pool, [1, 4], model.capacity.max_blocks_per_seq)
    for size in runner.batch_sizes:
        buffers, pad, inputs = runner._static_step(size)
        graph = DirectStepGraph()
        with torch.inference_mode():
            runner.graphs[size] = _Captured(graph, buffers, pad, graph.capture(model.gm, inputs, "decode", "-"))
    monkeypatch.setattr(model, "cuda_graphs", runner)
    decode_rows, rows_of = [], state_decode.decode_rows
    monkeypatch.setattr(state_decode, "decode_rows", lambda slots, *a: decode_rows.append(slots.shape[0]) or
                        rows_of(slots, *a))
    result = run_check(model.path, steps=4, prompt_lens=(5, 7, 3), chunk_size=8, compiled=model)
    assert result.passed, result.summary()
    assert 4 in decode_rows and set(decode_rows) == {1, 4}  # every decode step a replay (3 sequences: padded to 4)


def test_padding_rows_write_no_cache_slot(compiled):
    model = compiled("llama")
    chunks = [SequenceChunk((5, 6, 7), 0, (1,)), SequenceChunk((9, 8), 4, (2,))]
    assert model.piecewise.padding(chunks).num_tokens == 16  # 11 padding rows
    for cache in model.pool.caches:
        cache.zero_()
    model(chunks)
    for cache in model.pool.caches:  # [blocks, k/v, slot, heads, dim]
        written = (cache != 0).flatten(3).any(-1).any(1).nonzero().tolist()
        assert written == [[1, 0], [1, 1], [1, 2], [2, 4], [2, 5]]


def test_a_follower_rank_replays_from_its_own_buffers(compiled):
    """Tensor parallelism: the other ranks receive rank 0's padded step as one flat tensor."""
    model = compiled("llama")
    chunks = [SequenceChunk(tuple(range(3, 12)), 0, (1,)), SequenceChunk((9,), 4, (2,))]
    batch = model.prepare(chunks)
    assert batch.num_tokens == 16
    flat = torch.cat([getattr(batch, n).reshape(-1) for n in GRAPH_INPUTS]).clone()
    caches = [c.clone() for c in model.pool.caches]
    want = model.forward(batch).clone()
    for cache, saved in zip(model.pool.caches, caches):
        cache.copy_(saved)
    received = batch_from_flat(flat, batch.num_tokens, batch.num_seqs, batch.block_table.shape[1], batch.num_logits)
    assert received.input_ids.data_ptr() != batch.input_ids.data_ptr()
    assert torch.equal(model.forward(received), want)


def test_the_start_up_report_says_what_was_captured(compiled):
    table = compiled("llama").report.pass_table()
    assert "piecewise: 3 pieces x 3 token buckets (4-32), 3 eager parts between them, 9 captures in" in table


def test_the_servers_start_up_report_names_the_piecewise_graphs(compiled):
    from autodeploy.serve.startup import cuda_graph_line

    line = cuda_graph_line(None, compiled("llama").piecewise)
    assert line.startswith("none (not on CUDA")
    assert "; piecewise: 3 pieces x 3 token buckets (4-32), 3 eager parts between them (captured in " in line


def test_a_step_beyond_the_largest_bucket_runs_the_graph_eagerly(compiled):
    model = compiled("llama")
    chunks = [SequenceChunk(tuple(range(3, 33)), 0, (3, 4)), SequenceChunk((7, 8, 9), 5, (5,))]  # 33 tokens
    assert model.piecewise.padding(chunks) is None
    batch = model.prepare(chunks)
    assert batch.num_tokens == 33 and not model.piecewise.takes(batch)
    caches = [c.clone() for c in model.pool.caches]
    for piece in model.piecewise.split.captured:  # any replay would fail the test
        getattr(model.piecewise.split.outer, piece).entries.clear()
    try:
        logits = model(chunks).clone()
    finally:
        model.piecewise.capture()
    for cache, saved in zip(model.pool.caches, caches):
        cache.copy_(saved)
    assert torch.equal(logits, _eager(model, batch))


def test_captures_happen_at_compile_time_only(compiled):
    model = compiled("llama")
    assert len(model.captures_at_compile) == model.piecewise.num_captures == 3 * len(SIZES)
    assert model.captures_at_compile[0] == "piece submod_0 at 32 tokens"  # largest bucket first
    with counting_captures() as captures:
        model([SequenceChunk((1,) * 20, 0, (3, 4))])  # bucket 32
        model([SequenceChunk((1,) * 60, 0, (3, 4, 5, 6))])  # larger than every bucket: eager
    assert captures == []


def test_a_capture_failure_names_the_op_and_its_layer(compiled):
    model = compiled("llama")
    gm = copy.deepcopy(model.gm)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "swiglu_down" in str(n.target))

    def refuses_capture(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    node.target = refuses_capture
    gm.recompile()
    runner = PiecewiseRunner(gm, model.pool, [4], 8, 4)
    with pytest.raises(CaptureError) as err:
        runner.capture()
    message = str(err.value)
    assert "refuses_capture" in message and "reading model_layers_0_mlp_down_proj_weight" in message
    assert "piece submod_2 at 4 tokens" in message and "--set passes.compile_cuda_graphs.piecewise=false" in message


def test_a_step_output_made_by_a_piece_is_copied_out_of_the_pool(compiled):
    """Were the logits computed inside a piece, the next replay would overwrite them."""
    gm = copy.deepcopy(compiled("llama").gm)
    last = [n for n in gm.graph.nodes if n.op == "call_function" and "swiglu_down" in str(n.target)][-1]
    gm.graph.output_node().args = (last,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    split = split_at_eager_ops(gm)
    copied = split.outer.graph.output_node().args[0]
    assert copied.target == torch.ops.aten.clone.default and copied.args[0].target == split.captured[-1]


def test_bucket_sizes(compiled):
    assert default_piecewise_sizes(8192)[:12] == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160]
    assert default_piecewise_sizes(8192)[-5:] == [1024, 1280, 1536, 1792, 2048] and len(default_piecewise_sizes(8192)) == 31
    assert default_piecewise_sizes(300)[-2:] == [256, 300]
    model = compiled("llama")
    runner = model.piecewise
    assert runner.padding([SequenceChunk((1,) * 17, 0, (1, 2))]).num_tokens == 32
    assert runner.padding([SequenceChunk((1,) * 33, 0, (1, 2, 3))]) is None
    assert runner.padding([SequenceChunk((1,), 0, (1,))] * 9) is None  # more sequences than max_batch_size


def _apply_pass(model, properties=("state_is_kv_only",), **config):
    return apply_cuda_graph_pass(model, {"piecewise": True, "piecewise_on_cpu": True} | config, "piecewise_graphs", properties)


def test_piecewise_is_a_switch_on_by_default_and_its_sizes_are_set_by_config(compiled):
    from autodeploy.config import parse_set_option
    from autodeploy.passes.compile_cuda_graphs import CudaGraphConfig

    model = compiled("llama")
    runner, detail = _apply_pass(model, piecewise=False)
    assert runner is None and "piecewise graphs: off (passes.compile_cuda_graphs.piecewise=false)" in detail
    assert CudaGraphConfig().piecewise is True  # the default (CUDA only: piecewise_on_cpu is for tests)
    key, value = parse_set_option("passes.compile_cuda_graphs.piecewise_sizes=[8, 100]")
    assert key == "passes.compile_cuda_graphs.piecewise_sizes" and value == [8, 100]
    runner, detail = _apply_pass(model, piecewise_sizes=value)
    assert runner.sizes == [8, 64]  # at most max_num_tokens
    assert "piecewise: 3 pieces x 2 token buckets (8-64), 3 eager parts between them, 6 captures in" in detail
    runner, detail = _apply_pass(model, piecewise_sizes=[])
    assert runner is None and "piecewise graphs: none asked for" in detail
    runner, detail = _apply_pass(model, properties=())
    assert runner is None and "check_uncached_state did not prove" in detail


def test_canary_passes_through_piecewise_steps(compiled):
    from autodeploy.check import run_check

    model = compiled("llama")
    result = run_check(model.path, steps=4, prompt_lens=(3, 9, 21), chunk_size=8, compiled=model)
    assert result.passed, result.summary()
