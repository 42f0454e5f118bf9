"""The fusion passes in the real pipeline on a tiny Llama: fused graph, weights streamed through the
load hooks straight from safetensors, and the correctness canary on the CPU (torch and Triton backends)."""


import pytest
import torch
from safetensors.torch import load_file

import autodeploy
from autodeploy.check import run_check
from autodeploy.model_loading import SafetensorsSource
from autodeploy.passes import load_weights
from autodeploy.tiny import make_tiny_checkpoint

# match_moe lives on another branch until it is merged; a llama has no MoE either way


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))
    sources = []
    original = load_weights.choose_weight_source

    def recording(*args):
        sources.append(original(*args))
        return sources[-1]

    load_weights.choose_weight_source = recording
    try:
        model = autodeploy.compile(path, device="cpu", dtype="float32", max_seq_len=64)
    finally:
        load_weights.choose_weight_source = original
    return path, model, sources


def test_fused_graph_and_hook_loading(compiled):
    path, model, sources = compiled
    counts = model.report.op_counts
    assert counts["swiglu_down"] == 2 and counts.get("swiglu", 0) == 0
    # every norm reads straight into its linear, the final one too (its rows are gathered before it)
    norms = (counts["rms_norm_linear"], counts["add_rms_norm_linear"], counts.get("fused_add_rms_norm", 0))
    assert norms == (1, 4, 0)
    # each layer's q/k rotation: one rope_qk (fuse stage), then folded into its paged attention
    assert counts.get("rope_qk", 0) == 0 and counts.get("rope", 0) == 0
    attentions = model.gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.paged_attention.default)
    assert len(attentions) == 2 and all(n.kwargs["rope_cos"] is not None for n in attentions)
    # RoPE's cos/sin (eight small kernels per step): two tables over the pool's 64 positions, gathered
    targets = [n.target for n in model.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.cos.default not in targets and torch.ops.aten.bmm.default not in targets
    gathers = [n for n in model.gm.graph.nodes if n.meta.get("autodeploy_provenance") == "tabulate_positions"]
    assert [n.target for n in gathers] == [torch.ops.aten.index_select.default] * 2
    assert sorted(tuple(b.shape) for n, b in model.gm.named_buffers() if n.startswith("position_table")) == [
        (1, 64, 16), (1, 64, 16)]
    assert [type(s) for s in sources] == [SafetensorsSource]  # no fallback to a second host copy
    state = load_file(next(path.glob("*.safetensors")))
    params = dict(model.gm.named_parameters())
    prefix = "model.layers.1.self_attn."
    want = torch.cat([state[prefix + f"{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(params[prefix + "fused_q_proj_k_proj_v_proj.weight"], want, atol=0, rtol=0)
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in params)


def test_canary_passes_with_fusions(compiled):
    path, model, _ = compiled
    result = run_check(path, steps=4, prompt_lens=(5, 12, 9), chunk_size=4, compiled=model)
    assert result.passed, result.summary()


def test_canary_passes_on_the_triton_backend(compiled):
    """The same graph with the Triton paged-attention op (interpreter): prefill, chunks, decode."""
    path, model, _ = compiled
    for node in model.gm.graph.nodes:
        if node.target == torch.ops.autodeploy.paged_attention.default:
            node.target = torch.ops.autodeploy.paged_attention_triton.default
    model.gm.recompile()
    try:
        result = run_check(path, steps=3, prompt_lens=(5, 9), chunk_size=4, compiled=model)
    finally:
        for node in model.gm.graph.nodes:
            if node.target == torch.ops.autodeploy.paged_attention_triton.default:
                node.target = torch.ops.autodeploy.paged_attention.default
        model.gm.recompile()
    assert result.passed, result.summary()


def test_rope_stays_a_separate_op_with_the_fold_switched_off(tiny_llama):
    model = autodeploy.compile(tiny_llama, device="cpu", dtype="float32", max_seq_len=64,
                               passes={"fuse_rope_attention": {"enabled": False}})
    assert model.report.op_counts["rope_qk"] == 2
    result = run_check(tiny_llama, steps=2, prompt_lens=(5, 9), chunk_size=4, compiled=model)
    assert result.passed, result.summary()
