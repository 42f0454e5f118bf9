"""Quantization configs as each producer writes them -> QuantPlan; everything else is refused."""

import json

import pytest

from autodeploy.errors import QuantizationError
from autodeploy.quantization.readers import read_quant_plan
from autodeploy.quantization.scheme import QuantPlan

from quant_fixtures import edit_json, fixture_dir


@pytest.mark.parametrize("name, method, scale, activations", [
    ("llama_ct_fp8_dynamic", "compressed-tensors FP8_DYNAMIC", "channel", "token"),
    ("qwen3_ct_fp8_static", "compressed-tensors FP8", "tensor", "static"),
    ("llama_ct_fp8_block", "compressed-tensors FP8_BLOCK", "block", "group"),
    ("llama_modelopt_fp8", "modelopt FP8", "tensor", "static"),
    ("qwen3_modelopt_nvfp4", "modelopt NVFP4", "nvfp4", "none"),
    ("llama_ct_fp8_kv", "compressed-tensors FP8_DYNAMIC", "channel", "token"),
    ("qwen3_modelopt_fp8_kv", "modelopt FP8", "tensor", "static"),
])
def test_producer_configs(name, method, scale, activations):
    plan = read_quant_plan(fixture_dir(name))
    assert (plan.method, plan.format.weight_scale, plan.format.activations) == (method, scale, activations)
    assert plan.is_excluded("lm_head") and not plan.is_excluded("model.layers.0.self_attn.q_proj")


def test_block_structure_and_group_size():
    fmt = read_quant_plan(fixture_dir("llama_ct_fp8_block")).format
    assert fmt.block_size == (32, 32) and fmt.group_size == 32


def _write(tmp_path, config=None, hf_quant=None):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **(config or {})}))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return tmp_path


def test_block_fp8_as_deepseek_and_qwen3_release_it(tmp_path):
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
          "modules_to_not_convert": ["lm_head"]}
    plan = read_quant_plan(_write(tmp_path, {"quantization_config": qc}))
    assert plan.format.scale_name == "weight_scale_inv" and plan.format.block_size == (128, 128)
    assert plan.format.activations == "group" and plan.excluded == ("lm_head",)


def test_modelopt_in_config_json_and_kv_cache(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    plan = read_quant_plan(_write(tmp_path, {"quantization_config": qc}))
    assert plan.method == "modelopt FP8" and plan.kv_cache == "FP8"


def test_online_plans(tmp_path):
    plain = _write(tmp_path)
    assert read_quant_plan(plain) is None
    plan = read_quant_plan(plain, "fp8")
    assert plan.online and (plan.format.weight_scale, plan.format.activations) == ("channel", "token")
    assert read_quant_plan(plain, "nvfp4").format.kind == "nvfp4"


@pytest.mark.parametrize("config, hf_quant, message", [
    ({"quantization_config": {"quant_method": "awq"}}, None, "quant_method 'awq' is not supported"),
    (None, {"quantization": {"quant_algo": "W4A8_AWQ"}}, "quant_algo 'W4A8_AWQ' is not supported"),
    (None, {"quantization": {"quant_algo": "NVFP4", "group_size": 32}}, "group_size 32"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}, None, "weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}},
     None, "activation_scheme 'static'"),
])
def test_unsupported_schemes_are_named(tmp_path, config, hf_quant, message):
    with pytest.raises(QuantizationError, match=message):
        read_quant_plan(_write(tmp_path, config, hf_quant))


@pytest.mark.parametrize("edit, message", [
    (lambda g: g["weights"].update(num_bits=4, type="int"), "4-bit int"),
    (lambda g: g["weights"].update(strategy="group"), "strategy 'group'"),
    (lambda g: g["input_activations"].update(strategy="tensor"), "dynamic"),
])
def test_compressed_tensors_schemes_we_cannot_run(fixture_copy, edit, message):
    path = fixture_copy("llama_ct_fp8_dynamic")
    edit_json(path / "config.json", lambda c: edit(c["quantization_config"]["config_groups"]["group_0"]))
    with pytest.raises(QuantizationError, match=message):
        read_quant_plan(path)


def test_two_config_groups_are_refused(fixture_copy):
    path = fixture_copy("llama_ct_fp8_dynamic")

    def add_group(config):
        groups = config["quantization_config"]["config_groups"]
        groups["group_1"] = groups["group_0"]

    edit_json(path / "config.json", add_group)
    with pytest.raises(QuantizationError, match="2 config groups"):
        read_quant_plan(path)


def test_online_quantization_of_a_quantized_checkpoint_is_refused():
    with pytest.raises(QuantizationError, match="already quantized"):
        read_quant_plan(fixture_dir("llama_modelopt_fp8"), "fp8")


@pytest.mark.parametrize("pattern, module, matches", [
    ("lm_head", "lm_head", True), ("lm_head", "model.lm_head", True), ("lm_head", "model.lm_heads", False),
    ("re:.*mlp.gate$", "model.layers.3.mlp.gate", True), ("re:.*mlp.gate$", "model.layers.3.mlp.gate_proj", False),
    ("*self_attn*", "model.layers.0.self_attn.q_proj", True), ("model.layers.1*", "model.layers.0.mlp", False),
])
def test_exclusion_patterns(pattern, module, matches):
    plan = QuantPlan("test", read_quant_plan(fixture_dir("llama_modelopt_fp8")).format, (pattern,))
    assert plan.is_excluded(module) is matches


@pytest.mark.parametrize("name, vllm_name", [
    ("llama_modelopt_fp8", "modelopt"), ("qwen3_modelopt_nvfp4", "modelopt_fp4"),
    ("llama_ct_fp8_dynamic", "compressed-tensors"), ("llama_ct_fp8_block", "compressed-tensors"),
])
def test_vllms_name_of_the_stored_format_confirms_it(name, vllm_name):
    """vLLM's --quantization names a checkpoint's own scheme: the stored plan, not an online one."""
    assert read_quant_plan(fixture_dir(name), vllm_name) == read_quant_plan(fixture_dir(name))


def test_vllms_fp8_of_a_block_fp8_checkpoint_is_the_checkpoint(tmp_path):
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = _write(tmp_path, {"quantization_config": qc})
    assert read_quant_plan(path, "fp8") == read_quant_plan(path)


@pytest.mark.parametrize("name, vllm_name, message", [
    ("llama_modelopt_fp8", "modelopt_fp4", r"already quantized \(modelopt FP8\)"),
    ("qwen3_modelopt_nvfp4", "compressed-tensors", r"already quantized \(modelopt NVFP4\)"),
    ("llama_ct_fp8_dynamic", "nvfp4", "already quantized"),
    (None, "modelopt", "names a quantized checkpoint format, but this checkpoint is not quantized"),
    (None, "compressed-tensors", "online quantization: fp8, nvfp4"),
])
def test_a_name_that_does_not_match_the_checkpoint_is_refused(tmp_path, name, vllm_name, message):
    path = fixture_dir(name) if name else _write(tmp_path)
    with pytest.raises(QuantizationError, match=message):
        read_quant_plan(path, vllm_name)
