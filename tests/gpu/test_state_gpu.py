"""The state ops' decode kernels compiled for the GPU, and a Mamba-2 hybrid's decode steps captured in
CUDA graphs (no timing: ``bench/full_table.py --sections decode --shapes bamba2b`` times them). Skipped without CUDA;
conftest turns the interpreter on, so run

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/gpu/test_state_gpu.py
"""

import os

import pytest
import torch

from autodeploy.kernels.state_update import conv_update, ssm_update
from autodeploy.kvcache.allocator import BlockAllocator, blocks_needed
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.ops import state_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]


def _metadata(batch: int, padded: int):
    """A decode step of ``batch`` sequences in slots 2b + 1 (context 3b, the first none) padded to ``padded``."""
    cu = torch.tensor(list(range(batch + 1)) + [batch] * (padded - batch), device="cuda")
    slots = torch.tensor([2 * b + 1 for b in range(batch)] + [-1] * (padded - batch), device="cuda")
    context = torch.tensor([3 * b for b in range(batch)] + [0] * (padded - batch), device="cuda")
    return {"state_slots": slots, "cu_seqlens": cu, "context_lens": context}


def _mamba_inputs(rows: int, dtype, heads=64, head_dim=64, groups=8, state=128, channels=4096 + 2 * 8 * 128):
    x = torch.randn(rows, channels, dtype=dtype, device="cuda")
    return {
        "conv": (x, torch.randn(channels, 4, dtype=dtype, device="cuda"), torch.randn(channels, dtype=dtype, device="cuda")),
        "ssm": (torch.randn(rows, heads, head_dim, dtype=dtype, device="cuda"),
                torch.nn.functional.softplus(torch.randn(rows, heads, device="cuda")).to(dtype),
                -torch.rand(heads, device="cuda") - 0.1,
                torch.randn(rows, groups, state, dtype=dtype, device="cuda"),
                torch.randn(rows, groups, state, dtype=dtype, device="cuda")),
        "states": (torch.randn(2 * rows + 2, channels, 3, device="cuda").to(dtype),
                   torch.randn(2 * rows + 2, heads, head_dim, state, device="cuda")),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_kernels_equal_the_batched_torch_step_at_model_sizes(dtype, monkeypatch):
    inputs, meta = _mamba_inputs(64, dtype), _metadata(60, 64)
    conv_state, ssm_state = inputs["states"]
    got_states = conv_state.clone(), ssm_state.clone()
    got = (conv_update(*inputs["conv"], got_states[0], **meta), ssm_update(*inputs["ssm"], got_states[1], **meta))
    monkeypatch.setenv("AUTODEPLOY_TRITON_KERNELS", "0")  # the batched torch form
    want_states = conv_state.clone(), ssm_state.clone()
    want = (state_decode.conv_step(*inputs["conv"], want_states[0], **meta),
            state_decode.ssm_step(*inputs["ssm"], want_states[1], **meta))
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}
    for g, w in zip((*got, *got_states), (*want, *want_states)):
        torch.testing.assert_close(g, w, **tol)
    assert not got[0][60:].any() and not got[1][60:].any()  # padding rows


def test_decode_kernels_replay_in_a_cuda_graph():
    """Captured once on static inputs, replayed after the metadata changed in place: as launched eagerly."""
    inputs, meta = _mamba_inputs(8, torch.bfloat16), _metadata(3, 8)
    conv_state, ssm_state = inputs["states"]
    saved = conv_state.clone(), ssm_state.clone()
    run = lambda: (conv_update(*inputs["conv"], conv_state, **meta), ssm_update(*inputs["ssm"], ssm_state, **meta))
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    for name, value in _metadata(7, 8).items():
        meta[name].copy_(value)
    conv_state.copy_(saved[0]), ssm_state.copy_(saved[1])
    graph.replay()
    replayed = [t.clone() for t in (*outputs, conv_state, ssm_state)]
    conv_state.copy_(saved[0]), ssm_state.copy_(saved[1])
    eager = [*run(), conv_state, ssm_state]
    for r, e in zip(replayed, eager):
        assert torch.equal(r, e)


def test_a_hybrid_compiles_with_decode_graphs_and_a_replayed_step_equals_the_eager_one(tmp_path, monkeypatch):
    """A tiny bamba on CUDA: decode graphs captured; a replayed decode step (Triton decode kernels, one
    padding row) equals the same step run eagerly through the per-sequence references; the canary passes."""
    from autodeploy.check import run_check
    from autodeploy.compiler import compile as compile_model
    from autodeploy.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint("bamba", tmp_path / "bamba")
    model = compile_model(model_dir, dtype="float32", device="cuda", max_seq_len=64, max_batch_size=8)
    assert model.cuda_graphs is not None and model.cuda_graphs.batch_sizes == [1, 2, 4, 8], model.report.pass_table()
    allocator = BlockAllocator(model.num_blocks)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 2)]
    blocks = [tuple(allocator.allocate(blocks_needed(len(p) + 1, model.block_size))) for p in prompts]
    model([SequenceChunk(tuple(p), 0, b, state_slot=i) for i, (p, b) in enumerate(zip(prompts, blocks))])
    step = [SequenceChunk((7,), len(p), b, state_slot=i) for i, (p, b) in enumerate(zip(prompts, blocks))]
    pools = [*model.pool.caches, *model.pool.state.states]
    saved = [t.clone() for t in pools]
    replayed = model(step).clone()  # the graph of 4 sequences, one padding row
    after = [t.clone() for t in pools]
    for t, s in zip(pools, saved):
        t.copy_(s)
    monkeypatch.setattr(state_decode, "is_decode_step", lambda *a: False)  # the per-sequence references
    batch = BatchMetadata.build(step, model.block_size, model.device)
    with torch.inference_mode():
        eager = model.gm(**batch.as_kwargs(), **model.pool.as_kwargs())
    monkeypatch.undo()
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    for t, a in zip(pools, after):
        torch.testing.assert_close(t, a, atol=1e-4, rtol=1e-4)
    result = run_check(model_dir, steps=8, prompt_lens=(5, 9, 2), compiled=model)
    assert result.passed, result.summary()
