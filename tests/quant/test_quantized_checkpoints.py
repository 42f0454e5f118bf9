"""Quantized checkpoints from the real producers compile and match their reference (the canary:
staggered, chunked, mixed batches). compressed-tensors checkpoints are compared with transformers
running them through the producer's own package (weights dequantized, activations fake-quantized by
compressed-tensors itself); ModelOpt (which transformers does not read) with the HF model on the
weights dequantized as the format says, activations fake-quantized likewise."""

import pytest
import torch
from quant_fixtures import block_fp8_checkpoint, edit_json, fixture_dir
from safetensors.torch import load_file, save_file

import autodeploy
from autodeploy.check import run_check
from autodeploy.errors import AutoDeployError

pytestmark = pytest.mark.slow  # each compiles a model and runs HF as the reference


@pytest.mark.parametrize("name", ["llama_ct_fp8_dynamic", "qwen3_ct_fp8_static", "llama_ct_fp8_block",
                                  "llama_modelopt_fp8", "qwen3_modelopt_nvfp4"])
def test_producer_checkpoints_match_their_reference(name):
    result = run_check(fixture_dir(name), steps=8, prompt_lens=(5, 19))
    assert result.passed, result.summary()


def test_moe_with_quantized_experts():
    # the experts are dequantized at load: the moe op runs them on unquantized activations, where
    # compressed-tensors rounds their inputs to FP8 too; the attention linears are exact
    result = run_check(fixture_dir("qwen3_moe_ct_fp8_dynamic"), steps=8, prompt_lens=(5, 19), rel_tol=2e-3)
    assert result.passed, result.summary()
    model = autodeploy.compile(fixture_dir("qwen3_moe_ct_fp8_dynamic"), dtype="float32", device="cpu", max_seq_len=32)
    assert any("dequantized to the model dtype while loading" in line for line in model.report.quantization)
    assert model.gm.get_parameter("model.layers.0.mlp.experts.gate_up_proj").dtype == torch.float32


def test_block_fp8_matches_its_reference_and_transformers_dequantized_model(tmp_path):
    path = block_fp8_checkpoint(tmp_path)
    result = run_check(path, steps=8, prompt_lens=(5, 19))
    assert result.passed, result.summary()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # transformers dequantizes on the CPU
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits[0]
    got = _prefill_logits(path, tokens[0].tolist())
    # ours also rounds activations to FP8 (per token, groups of 16): close, not equal
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def _prefill_logits(path, tokens):
    from autodeploy.kvcache.metadata import SequenceChunk

    model = autodeploy.compile(path, dtype="float32", device="cpu", max_seq_len=64, num_kv_blocks=8)
    chunk = SequenceChunk(tuple(tokens), 0, tuple(range(8)), num_logits=len(tokens))
    return model([chunk]).float()


def _drop_tensor(path, name):
    state = load_file(path / "model.safetensors")
    del state[name]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _compile(path):
    return autodeploy.compile(path, dtype="float32", device="cpu", max_seq_len=32, num_kv_blocks=4)


def test_a_missing_scale_names_the_scheme_and_the_tensor(fixture_copy):
    path = fixture_copy("llama_ct_fp8_dynamic")
    _drop_tensor(path, "model.layers.0.self_attn.k_proj.weight_scale")
    with pytest.raises(AutoDeployError, match="compressed-tensors FP8_DYNAMIC: "
                                              "model.layers.0.self_attn.k_proj.weight_scale is missing"):
        _compile(path)


def test_a_missing_nvfp4_global_scale(fixture_copy):
    path = fixture_copy("qwen3_modelopt_nvfp4")
    _drop_tensor(path, "model.layers.0.mlp.down_proj.weight_scale_2")
    with pytest.raises(AutoDeployError, match="modelopt NVFP4: model.layers.0.mlp.down_proj.weight_scale_2 is missing"):
        _compile(path)


def test_block_scales_that_do_not_fit_the_declared_blocks(fixture_copy):
    path = fixture_copy("llama_ct_fp8_block")  # scales of 32 x 32 blocks, config says 16 x 16
    edit_json(path / "config.json", lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        weights={**c["quantization_config"]["config_groups"]["group_0"]["weights"], "block_structure": [16, 16]},
        input_activations={**c["quantization_config"]["config_groups"]["group_0"]["input_activations"],
                           "group_size": 16}))
    with pytest.raises(AutoDeployError, match=r"weight_scale has shape \[2, 2\], but a 64x64 weight in 16x16 blocks"):
        _compile(path)


def test_a_width_that_does_not_split_into_blocks(fixture_copy):
    path = fixture_copy("llama_ct_fp8_block")
    edit_json(path / "config.json", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        block_structure=[48, 48]))
    with pytest.raises(AutoDeployError, match="64 input features, which do not split into blocks of 48"):
        _compile(path)


def test_fp8_tensors_without_a_quantization_config_are_refused(fixture_copy):
    path = fixture_copy("llama_ct_fp8_dynamic")
    edit_json(path / "config.json", lambda c: c.pop("quantization_config"))
    with pytest.raises(AutoDeployError, match="stores 7 FP8 tensors .* but declares no quantization"):
        _compile(path)


def test_a_quantized_tensor_the_producer_says_it_excluded(fixture_copy):
    path = fixture_copy("llama_modelopt_fp8")
    edit_json(path / "hf_quant_config.json", lambda c: c["quantization"]["exclude_modules"].append("*o_proj"))
    with pytest.raises(AutoDeployError, match="o_proj.weight is stored quantized, but the checkpoint's exclusion"):
        _compile(path)
