"""The FP8 KV cache's settings: ``kv_cache_dtype`` against the checkpoint's KV scheme, and the per-layer
k/v scales as each producer stores them; every bad value refused with the tensor or setting it names."""

import json

import pydantic
import pytest
import torch
from safetensors.torch import save_file

from autodeploy.config import CompileConfig
from autodeploy.errors import QuantizationError
from autodeploy.quantization.kv_cache import read_kv_scales, resolve_kv_cache
from autodeploy.quantization.readers import read_quant_plan

MODULES = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
CT_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
CT_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True}


def _plan(tmp_path, kv_scheme):
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": kv_scheme,
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS}}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return read_quant_plan(tmp_path)


@pytest.mark.parametrize("setting", ["fp8", "fp8_e4m3"])
def test_fp8_settings_on_any_checkpoint(setting):
    kv = resolve_kv_cache(setting, None, torch.bfloat16)
    assert kv.fp8 and kv.dtype == torch.float8_e4m3fn and not kv.model_dtype
    assert kv.describe() == f"float8_e4m3fn (--kv_cache_dtype {setting})"


def test_auto_follows_the_checkpoint(tmp_path):
    assert resolve_kv_cache("auto", None, torch.float16).model_dtype
    kv = resolve_kv_cache("auto", _plan(tmp_path, CT_KV), torch.bfloat16)
    assert kv.fp8 and "the checkpoint's" in kv.describe()
    kept = resolve_kv_cache("bfloat16", _plan(tmp_path, CT_KV), torch.bfloat16)  # an explicit float dtype wins
    assert kept.dtype == torch.bfloat16 and "the checkpoint asks for" in kept.describe()


@pytest.mark.parametrize("name", ["llama_ct_fp8_kv", "qwen3_modelopt_fp8_kv"])
def test_producers_kv_schemes(fixture_copy, name):
    path = fixture_copy(name)
    assert read_quant_plan(path).kv_cache_fp8
    (path / "hf_quant_config.json").unlink(missing_ok=True)  # ModelOpt's config.json spelling alone
    assert read_quant_plan(path).kv_cache_fp8


@pytest.mark.parametrize("scheme", [{**CT_KV, "num_bits": 4}, {**CT_KV, "type": "int"}, {**CT_KV, "strategy": "head"},
                                    {**CT_KV, "dynamic": True}])
def test_other_kv_schemes_are_refused_with_a_way_out(tmp_path, scheme):
    with pytest.raises(QuantizationError, match="--kv_cache_dtype bfloat16"):
        resolve_kv_cache("auto", _plan(tmp_path, scheme), torch.bfloat16)
    assert resolve_kv_cache("bfloat16", _plan(tmp_path, scheme), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "FP8", ""])
def test_unknown_kv_cache_dtypes_are_config_errors(value):
    with pytest.raises(pydantic.ValidationError, match="kv_cache_dtype"):
        CompileConfig(kv_cache_dtype=value)


def _scales(tmp_path, tensors: dict[str, torch.Tensor]):
    save_file(tensors, tmp_path / "model.safetensors")
    stored = {name: ("F32", tuple(t.shape)) for name, t in tensors.items()}
    return read_kv_scales((tmp_path / "model.safetensors",), MODULES, stored)


@pytest.mark.parametrize("k_leaf, v_leaf", [("k_scale", "v_scale"),  # compressed-tensors
                                             ("k_proj.k_scale", "v_proj.v_scale")])  # ModelOpt
def test_each_producers_scale_names(tmp_path, k_leaf, v_leaf):
    tensors = {f"{m}.{leaf}": torch.tensor(0.5 + i + j / 4) for i, m in enumerate(MODULES)
               for j, leaf in enumerate((k_leaf, v_leaf))}
    assert _scales(tmp_path, tensors) == ([(0.5, 0.75), (1.5, 1.75)], True)


def test_no_scales_means_one(tmp_path):
    assert _scales(tmp_path, {"model.norm.weight": torch.ones(4)}) == ([(1.0, 1.0)] * 2, False)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor(-0.5), "one positive scale"),
    (torch.tensor(0.0), "one positive scale"),
    (torch.tensor(float("nan")), "one positive scale"),
    (torch.tensor([0.5, 0.5]), "per-head KV scales are not supported"),
])
def test_bad_scale_values_are_refused(tmp_path, bad, message):
    tensors = {f"{m}.{leaf}": torch.tensor(0.5) for m in MODULES for leaf in ("k_scale", "v_scale")}
    tensors["model.layers.1.self_attn.v_scale"] = bad
    with pytest.raises(QuantizationError, match=rf"model.layers.1.self_attn.v_scale .*{message}"):
        _scales(tmp_path, tensors)


def test_scales_for_some_layers_or_a_lone_k_scale_are_refused(tmp_path):
    first = {f"{MODULES[0]}.{leaf}": torch.tensor(0.5) for leaf in ("k_scale", "v_scale")}
    with pytest.raises(QuantizationError, match="for 1 of 2 attention layers; none for layer 1"):
        _scales(tmp_path, first)
    lone = {**first, f"{MODULES[1]}.k_scale": torch.tensor(0.5)}
    with pytest.raises(QuantizationError, match="self_attn.k_scale is stored but not its v_scale partner"):
        _scales(tmp_path, lone)


# End to end (the canary: staggered, chunked, mixed batches against HF eager in fp32).
# llm-compressor's checkpoint runs in transformers through compressed-tensors, which rounds k and v
# through e4m3 with the same scales: the FP8 cache must agree to the last bit of fp32 arithmetic.
# transformers does not run ModelOpt's KV quantization (its reference keeps k/v in fp32), nor the
# plain checkpoint's: quality then, not equality. e4m3 keeps 3 mantissa bits (each cached element
# within 2^-4 of itself); measured here: max rel err 1.1e-2 (ModelOpt), 2-6e-2 (scale 1.0 on tiny
# random models), greedy top-1 agreement 100%.
KV_REL_TOL, KV_AGREEMENT = 0.1, 0.9


@pytest.mark.parametrize("name, scales", [("llama_ct_fp8_kv", (0.0010528564453125, 0.0012969970703125)),
                                          ("qwen3_modelopt_fp8_kv", (0.006417410913854837, 0.0013166154967620969))])
def test_producer_checkpoints_with_kv_scales(name, scales):
    from quant_fixtures import fixture_dir

    import autodeploy
    from autodeploy.check import run_check

    model = autodeploy.compile(fixture_dir(name), dtype="float32", device="cpu", max_seq_len=32)
    assert model.pool.caches[0].dtype == torch.float8_e4m3fn
    assert "float8_e4m3fn (the checkpoint's" in model.report.quantization_lines()[-1]
    ops = [n for n in model.gm.graph.nodes if n.op == "call_function" and "paged_attention" in str(n.target)]
    assert [(n.kwargs["k_scale"], n.kwargs["v_scale"]) for n in ops] == [pytest.approx(scales, rel=1e-6)]
    result = run_check(fixture_dir(name), steps=8, prompt_lens=(5, 19), compiled=model)
    exact = name.startswith("llama_ct")
    assert result.passed if exact else result.max_rel_err <= KV_REL_TOL, result.summary()
    assert result.token_agreement >= KV_AGREEMENT, result.summary()


def test_fp8_kv_cache_on_an_unquantized_model(tiny_llama, caplog):
    import autodeploy
    from autodeploy.check import run_check

    model = autodeploy.compile(tiny_llama, dtype="float32", device="cpu", max_seq_len=32, kv_cache_dtype="fp8")
    assert "stores no calibrated k_scale/v_scale; every layer uses 1.0" in caplog.text
    assert model.report.quantization_lines() == [
        "none (weights in float32, KV cache float8_e4m3fn (--kv_cache_dtype fp8), scales 1.0 (the checkpoint has none))"]
    assert model.capacity.dtype_words() == "float8_e4m3fn, 4x the tokens of a float32 cache in the same memory"
    result = run_check(tiny_llama, steps=8, prompt_lens=(5, 19), compiled=model)
    assert result.max_rel_err <= KV_REL_TOL and result.token_agreement >= KV_AGREEMENT, result.summary()
    assert result.max_rel_err > 1e-4  # the cache is quantized: not the fp32 result
