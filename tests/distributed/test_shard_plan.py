"""The tensor-parallel plan, without processes or devices: derived from the canonical graph, exact
for Llama, refusing what it cannot split, a no-op at tp_size 1; scales sliced with their weights."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from autodeploy.passes.shard import Shard, ShardConfig, context_before_shard, plan_for_checkpoint
from autodeploy.passes.shard_groups import ParamShard, Part
from autodeploy.passes.shard_plan import derive_plan, hf_disagreements
from autodeploy.passes.shard_split import ShardError, SliceFix
from safetensors import safe_open
from safetensors.torch import save_file

from autodeploy.cli import main
from autodeploy.testing import export_for_test
from autodeploy.tiny import make_tiny_checkpoint

OPTIONS = {"dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("plan_llama"))


@pytest.fixture(scope="module")
def llama_ctx(llama):
    """The tiny Llama as the shard pass receives it (tp_size 1: plans below name their rank count)."""
    ctx, _ = context_before_shard(llama, **OPTIONS)
    return ctx


def _layer(i):
    attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    return [
        ("attention", attn, [(f"{attn}.q_proj.weight", "column", (32, 64)), (f"{attn}.k_proj.weight", "column", (16, 64)),
                             (f"{attn}.v_proj.weight", "column", (16, 64)), (f"{attn}.o_proj.weight", "row", (64, 32))]),
        ("gated_mlp", mlp, [(f"{mlp}.gate_proj.weight", "column", (64, 64)), (f"{mlp}.up_proj.weight", "column", (64, 64)),
                            (f"{mlp}.down_proj.weight", "row", (64, 64))]),
    ]


def test_llama_plan_matches_the_expected_list(llama_ctx):
    plan = derive_plan(llama_ctx.gm, 2)
    got = [(g.kind, g.name, [(p.name, p.role, p.local_shape()) for p in g.params]) for g in plan.groups]
    assert got == [*_layer(0), *_layer(1), ("lm_head", "lm_head", [("lm_head.weight", "column", (128, 64))])]
    assert [g.collective for g in plan.groups] == ["all_reduce"] * 4 + ["all_gather"]
    assert plan.replicated == ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                               "model.layers.0.post_attention_layernorm.weight", "model.layers.1.input_layernorm.weight",
                               "model.layers.1.post_attention_layernorm.weight", "model.norm.weight")
    assert plan.summary().startswith("2 ranks: 2 attention, 2 gated_mlp, 1 lm_head (heads 4 -> 2, kv heads 2 -> 1)")


def test_print_plan_from_the_command_line(llama, llama_ctx, capsys):
    assert main(["compile", str(llama), "--tp_size", "2", "--print-plan", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tensor-parallel plan over 2 ranks\nattention  model.layers.0.self_attn  heads 4 -> 2")
    assert "  row     model.layers.0.self_attn.o_proj.weight  [64, 64] -> [64, 32]" in out
    assert out.splitlines() == derive_plan(llama_ctx.gm, 2).lines()


def test_key_value_heads_fewer_than_ranks_are_replicated_in_groups(llama_ctx):
    plan = derive_plan(llama_ctx.gm, 4)
    k_proj = next(p for p in plan.groups[0].params if p.name.endswith("k_proj.weight"))
    assert k_proj.local_shape() == (16, 64)  # one of the 2 kv heads per rank
    assert [k_proj.parts[0].local(rank, 4) for rank in range(4)] == [(0, 16), (0, 16), (16, 16), (16, 16)]
    assert plan.groups[0].detail == "heads 4 -> 1, kv heads 2 -> 1"


def test_unsupported_splits_are_refused_at_compile_time(llama_ctx, tmp_path):
    with pytest.raises(ShardError, match="4 attention heads cannot be split over 3 ranks"):
        derive_plan(llama_ctx.gm, 3)
    olmo2 = make_tiny_checkpoint("olmo2", tmp_path / "olmo2")  # q/k norms over all heads at once
    with pytest.raises(ShardError, match="rms_norm.*across the sharded dimension"):
        plan_for_checkpoint(olmo2, tp_size=2, **OPTIONS)


def test_fused_checkpoint_projections_are_sharded_per_part(tmp_path):
    """Phi-3 stores q/k/v in one projection (its output sliced) and gate/up in one tensor (sliced)."""
    ctx, _ = context_before_shard(make_tiny_checkpoint("phi3", tmp_path / "phi3"), **OPTIONS)
    attention, mlp = derive_plan(ctx.gm, 2).groups[:2]
    qkv, gate_up = attention.params[0], mlp.params[0]
    assert (qkv.name, qkv.parts) == ("model.layers.0.self_attn.qkv_proj.weight",
                                     (Part(0, 64, 2), Part(64, 32, 2), Part(96, 32, 2)))
    assert [(f.start, f.end) for f in attention.fixes if isinstance(f, SliceFix)] == [(0, 32), (32, 48), (48, 64)]
    assert [p.local(1, 2) for p in qkv.parts] == [(32, 32), (80, 16), (112, 16)]  # rank 1: q heads 2-3, kv head 1
    assert (gate_up.parts, [(f.start, f.end) for f in mlp.fixes]) == ((Part(0, 128, 2), Part(128, 128, 2)),
                                                                       [(0, 64), (64, 128)])


def test_the_models_own_tp_plan_agrees(llama_ctx):
    plan, hf_plan = derive_plan(llama_ctx.gm, 2), llama_ctx.hf_config.base_model_tp_plan
    assert hf_plan and hf_disagreements(plan, hf_plan) == []
    swapped = {"layers.*.self_attn.o_proj": "colwise"}
    assert hf_disagreements(plan, swapped) == [
        f"model.layers.{i}.self_attn.o_proj.weight: row-parallel here, 'colwise' in the model's base_model_tp_plan"
        for i in (0, 1)]


def test_tp_size_1_leaves_the_graph_alone(llama_ctx):
    before = llama_ctx.gm.code
    result = Shard(ShardConfig()).apply(llama_ctx)
    assert (result.matches, result.detail) == (0, "tp_size 1: nothing to shard")
    assert llama_ctx.gm.code == before and llama_ctx.weight_slices == {}


def test_parameters_an_earlier_pass_builds_are_refused(llama_ctx):
    """Load hooks of an earlier pass (quantize) expect whole tensors: sharding their parameters is
    refused at compile time, not left to fail (or worse) while loading."""
    ctx = dataclasses.replace(llama_ctx, config=llama_ctx.config.model_copy(update={"tp_size": 2}),
                              hook_targets={"model.layers.0.self_attn.q_proj.weight": lambda: True})
    with pytest.raises(ShardError, match="1 planned parameters are built by an earlier pass's load hooks.*q_proj"):
        Shard(ShardConfig()).apply(ctx)


def test_a_slice_reads_only_its_part_from_safetensors(tmp_path):
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).view(4, 6, 3)  # an MoE gate_up: [experts, 2 x 3, hidden]
    save_file({"w": full}, tmp_path / "w.safetensors")
    shard = ParamShard("w", "column", (4, 6, 3), 1, (Part(0, 3, 3), Part(3, 3, 3)))  # gate and up, each in 3
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        got = [shard.read(handle.get_slice("w"), rank, 3) for rank in range(3)]
    for rank, part in enumerate(got):
        torch.testing.assert_close(part, torch.cat([full[:, rank:rank + 1], full[:, 3 + rank:4 + rank]], dim=1))
        torch.testing.assert_close(part, shard.read(full, rank, 3))  # a whole tensor (transformers' loading)
    with pytest.raises(RuntimeError, match="checkpoint shape"):
        shard.read(full[:2], 0, 3)


@torch.library.custom_op("tp_test::scaled_linear", mutates_args=())
def scaled_linear(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor) -> torch.Tensor:
    """A stand-in for a quantized linear: a per-output-channel scale and a per-tensor one."""
    return F.linear(input * input_scale, weight) * weight_scale


@scaled_linear.register_fake
def _(input, weight, weight_scale, input_scale):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


class _ScaledMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.up_scale = torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.rand(32) + 0.5)
        self.down, self.down_scale = torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.rand(16) + 0.5)
        self.in_up, self.in_down = torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        hidden = F.gelu(scaled_linear(x, self.up, self.up_scale, self.in_up))
        return scaled_linear(hidden, self.down, self.down_scale, self.in_down)


def test_quantized_linear_scales_are_sliced_with_their_weights():
    module = _ScaledMLP()
    x = torch.randn(5, 16)
    plan = derive_plan(export_for_test(module, (x,), {0: 0}), 2, lm_head=False)
    (group,) = plan.groups
    assert [(p.name, p.role, p.dim, p.local_shape()) for p in group.params] == [
        ("up", "column", 0, (16, 16)), ("up_scale", "column", 0, (16,)), ("down", "row", 1, (16, 16))]
    assert set(plan.replicated) == {"down_scale", "in_up", "in_down"}
    params = dict(module.named_parameters())
    partial = []
    for rank in range(2):  # what each rank computes from its slices; the all_reduce sums them
        local = {**params, **{p.name: p.read(params[p.name].detach(), rank, 2) for p in group.params}}
        hidden = F.gelu(scaled_linear(x, local["up"], local["up_scale"], local["in_up"]))
        partial.append(F.linear(hidden * local["in_down"], local["down"]))
    torch.testing.assert_close(sum(partial) * params["down_scale"], module(x), rtol=1e-5, atol=1e-5)


@torch.library.custom_op("tp_test::block_scaled_linear", mutates_args=())
def block_scaled_linear(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """A stand-in for a block-quantized linear: one scale per 4 x 4 block of the weight."""
    return F.linear(input, weight * weight_scale.repeat_interleave(4, 0).repeat_interleave(4, 1))


@block_scaled_linear.register_fake
def _(input, weight, weight_scale):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


class _BlockScaledMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.up_scale = torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.rand(8, 4) + 0.5)
        self.down, self.down_scale = torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.rand(4, 8) + 0.5)

    def forward(self, x):
        return block_scaled_linear(F.relu(block_scaled_linear(x, self.up, self.up_scale)), self.down, self.down_scale)


def test_block_scales_are_sliced_in_whole_blocks():
    module = _BlockScaledMLP()
    x = torch.randn(3, 16)
    (group,) = derive_plan(export_for_test(module, (x,), {0: 0}), 2, lm_head=False).groups
    assert [(p.name, p.dim, p.local_shape()) for p in group.params] == [
        ("up", 0, (16, 16)), ("up_scale", 0, (4, 4)), ("down", 1, (16, 16)), ("down_scale", 1, (4, 4))]
    params = {n: p.detach() for n, p in module.named_parameters()}
    partial = []
    for rank in range(2):
        local = {p.name: p.read(params[p.name], rank, 2) for p in group.params}
        hidden = F.relu(block_scaled_linear(x, local["up"], local["up_scale"]))
        partial.append(block_scaled_linear(hidden, local["down"], local["down_scale"]))
    torch.testing.assert_close(sum(partial), module(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ShardError, match="up_scale: tp_size 16 cuts rows 0..32 into slices of 2, not a whole number of its 4-row blocks"):
        derive_plan(export_for_test(module, (x,), {0: 0}), 16, lm_head=False)
