"""``--quantization fp8`` / ``nvfp4``: bf16/fp16 checkpoints quantized while they load."""

import pytest
import torch

import autodeploy
from autodeploy.check import run_check
from autodeploy.errors import AutoDeployError
from autodeploy.tiny import make_tiny_checkpoint

OPTIONS = dict(dtype="float32", device="cpu", max_seq_len=32, num_kv_blocks=4)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, method", [("llama", "fp8"), ("qwen3_moe", "fp8"), ("mistral", "nvfp4")])
def test_online_quantization_matches_its_reference(tmp_path, model_type, method):
    path = make_tiny_checkpoint(model_type, tmp_path / model_type)
    result = run_check(path, steps=8, prompt_lens=(5, 19), quantization=method)
    assert result.passed, result.summary()


def test_only_quantized_weights_are_kept(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    model = autodeploy.compile(path, quantization="fp8", **OPTIONS)
    params = dict(model.gm.named_parameters())
    fp8 = {n for n, p in params.items() if p.dtype == torch.float8_e4m3fn}
    per_layer = {n.removeprefix("model.layers.0.") for n in fp8 if n.startswith("model.layers.0.")}
    assert len(fp8) == 8 and per_layer == {"self_attn.fused_q_proj_k_proj_v_proj.weight", "self_attn.o_proj.weight",
                                           "mlp.fused_gate_proj_up_proj.weight", "mlp.down_proj.weight"}
    quantized_modules = {n.rpartition(".")[0] for n in fp8}
    for module in quantized_modules:  # nothing of a quantized linear stays in fp32 but its scale
        assert {n for n in params if n.startswith(module + ".")} == {f"{module}.weight", f"{module}.weight_scale"}
    assert params["lm_head.weight"].dtype == torch.float32  # the LM head stays unquantized
    assert any("left unquantized: lm_head" in line for line in model.report.quantization)


def test_moe_router_and_experts_stay_unquantized(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe")
    model = autodeploy.compile(path, quantization="fp8", **OPTIONS)
    params = dict(model.gm.named_parameters())
    assert params["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32


def test_random_weights_in_each_format(tmp_path):
    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig
    from autodeploy.kvcache.metadata import SequenceChunk
    from autodeploy.tiny import tiny_config

    for method in ("fp8", "nvfp4"):
        config = CompileConfig(weights="random", quantization=method, **OPTIONS)
        model = compile_config(tiny_config("llama"), config)
        logits = model([SequenceChunk((1, 2, 3), 0, (0,))])
        assert torch.isfinite(logits).all()


def test_a_model_without_quantizable_linears_is_refused(tmp_path):
    path = make_tiny_checkpoint("gpt2", tmp_path / "gpt2")  # Conv1D projections: addmm, not aten.linear
    with pytest.raises(AutoDeployError, match="no linear layer of this model can be quantized"):
        autodeploy.compile(path, quantization="fp8", **OPTIONS)


def test_unknown_method_is_a_config_error(tmp_path):
    with pytest.raises(AutoDeployError, match="quantization"):
        autodeploy.compile(make_tiny_checkpoint("llama", tmp_path / "l"), quantization="int4", **OPTIONS)


def test_compile_command_reports_the_quantization(capsys):
    from quant_fixtures import fixture_dir

    from autodeploy.cli import main

    assert main(["compile", str(fixture_dir("qwen3_modelopt_nvfp4")), "--device", "cpu", "--max_seq_len", "32"]) == 0
    out = capsys.readouterr().out
    assert "quantization: modelopt NVFP4: NVFP4 (e2m1 weights" in out
    assert "left unquantized: lm_head (excluded by the checkpoint: lm_head, model.embed_tokens)" in out
    assert "KV cache dtype: bfloat16" in out and "nvfp4_rms_norm_linear=1" in out


@pytest.mark.parametrize("name", ["llama_modelopt_fp8", "qwen3_modelopt_nvfp4", "llama_ct_fp8_block",
                                  "qwen3_moe_ct_fp8_dynamic"])
def test_random_weights_in_a_stored_checkpoints_format(name):
    """``weights: random`` with a quantized checkpoint's config: the quantized parameters themselves are made
    random in their stored format (codes, unit scales), as a benchmark of that format wants."""
    from quant_fixtures import fixture_dir

    from autodeploy.kvcache.metadata import SequenceChunk

    model = autodeploy.compile(fixture_dir(name), weights="random", **OPTIONS)
    stored = {p.dtype for n, p in model.gm.named_parameters() if n.endswith(".weight")}
    assert stored & {torch.float8_e4m3fn, torch.uint8}
    logits = model([SequenceChunk((1, 2, 3), 0, (0,))])
    assert torch.isfinite(logits).all()
