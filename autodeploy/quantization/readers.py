"""Read a checkpoint's quantization config, as each producer writes it, into a :class:`QuantPlan`.

- ModelOpt (``hf_quant_config.json`` ``{"producer": {"name": "modelopt"}, "quantization": {...}}``,
  or ``config.json`` ``quantization_config`` with ``quant_method: modelopt``): ``quant_algo`` FP8
  (per-tensor weight and static input scales), FP8_PER_CHANNEL_PER_TOKEN, NVFP4 (group 16);
  ``exclude_modules``; ``kv_cache_quant_algo`` (FP8: an FP8 KV cache, ``quantization/kv_cache.py``).
- compressed-tensors (llm-compressor): one config group of 8-bit float weights, strategy
  ``tensor``/``channel``/``block``, input activations static per tensor, dynamic per token or
  dynamic per group (block); ``ignore``; ``kv_cache_scheme`` (8-bit float per tensor: an FP8 KV cache).
- Block-scaled FP8 (``quant_method: fp8``, DeepSeek-V3 / Qwen3 FP8 releases): ``weight_block_size``,
  ``weight_scale_inv``, dynamic activations per token group; ``modules_to_not_convert``.

Anything else (another method, another bit width, mixed formats) is a :class:`QuantizationError`
naming what was found: a checkpoint is never compiled with its quantization ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import QuantizationError
from .scheme import LinearFormat, QuantPlan

# ``--quantization``: fp8 quantizes a bf16/fp16 checkpoint per output channel with dynamic per-token
# activations (vLLM's and TensorRT-LLM's online FP8 too); nvfp4 as ModelOpt's NVFP4 weights
ONLINE_FORMATS = {"fp8": LinearFormat("fp8", "channel", "token"), "nvfp4": LinearFormat("nvfp4", "nvfp4", "none")}
ONLINE_METHODS = tuple(ONLINE_FORMATS)
# vLLM's --quantization names of stored formats (the plan's method starts with the value): with a
# checkpoint stored that way they only confirm it; with any other checkpoint they are an error
CHECKPOINT_METHODS = {"modelopt": "modelopt FP8", "modelopt_fp4": "modelopt NVFP4",
                      "compressed-tensors": "compressed-tensors", "fp8": "fp8 block"}


def read_quant_plan(model_dir: Path | None, online: str | None = None) -> QuantPlan | None:
    """The plan for ``model_dir`` (None for an unquantized checkpoint without ``online``)."""
    stored = _stored_plan(model_dir) if model_dir is not None else None
    if online is None:
        return stored
    if stored is not None:
        if stored.method.startswith(CHECKPOINT_METHODS.get(online, "\0")):
            return stored
        raise QuantizationError(f"--quantization {online}: the checkpoint is already quantized ({stored.method}); "
                                "serve it as it is, without --quantization")
    if online in CHECKPOINT_METHODS and online not in ONLINE_METHODS:
        raise QuantizationError(f"--quantization {online} names a quantized checkpoint format, but this checkpoint "
                                f"is not quantized; online quantization: {', '.join(ONLINE_METHODS)}")
    if online not in ONLINE_METHODS:
        raise QuantizationError(f"--quantization {online}: unknown method; known: {', '.join(ONLINE_METHODS)}")
    return QuantPlan(f"online {online}", ONLINE_FORMATS[online], excluded=("lm_head",), online=True)


def _stored_plan(model_dir: Path) -> QuantPlan | None:
    config = _json(model_dir / "config.json") or {}
    section = config.get("quantization_config")
    modelopt_file = _json(model_dir / "hf_quant_config.json")
    if modelopt_file is not None:
        return _modelopt(modelopt_file.get("quantization") or {}, "hf_quant_config.json")
    if section is None:
        return None
    method = section.get("quant_method")
    if method == "modelopt":
        return _modelopt(section, "config.json quantization_config")
    if method == "compressed-tensors":
        return _compressed_tensors(section)
    if method == "fp8":
        return _block_fp8(section)
    raise QuantizationError(f"config.json quantization_config: quant_method '{method}' is not supported; "
                            "supported: modelopt (FP8, NVFP4), compressed-tensors (FP8), fp8 (block-scaled)")


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QuantizationError(f"cannot parse {path}: {exc}") from exc


_MODELOPT_FORMATS = {
    "FP8": LinearFormat("fp8", "tensor", "static", input_scale_name="input_scale"),
    "FP8_PER_CHANNEL_PER_TOKEN": LinearFormat("fp8", "channel", "token"),
    "NVFP4": LinearFormat("nvfp4", "nvfp4", "none", input_scale_name="input_scale"),
}


def _modelopt(section: dict[str, Any], where: str) -> QuantPlan:
    algo = str(section.get("quant_algo") or "").upper()
    if algo not in _MODELOPT_FORMATS:
        raise QuantizationError(f"{where}: ModelOpt quant_algo '{section.get('quant_algo')}' is not supported; "
                                f"supported: {', '.join(_MODELOPT_FORMATS)}")
    if algo == "NVFP4" and int(section.get("group_size") or 16) != 16:
        raise QuantizationError(f"{where}: ModelOpt NVFP4 with group_size {section['group_size']} (only 16 exists)")
    excluded = tuple(section.get("exclude_modules") or section.get("ignore") or ())
    kv = section.get("kv_cache_quant_algo") or _modelopt_kv_scheme(section.get("kv_cache_scheme"))
    return QuantPlan(f"modelopt {algo}", _MODELOPT_FORMATS[algo], excluded, kv_cache=str(kv) if kv else None,
                     kv_cache_fp8=str(kv).upper() == "FP8")


def _modelopt_kv_scheme(scheme: dict[str, Any] | None) -> str | None:
    """ModelOpt's ``config.json`` spelling of its KV-cache algorithm (``kv_cache_scheme``, no strategy: per tensor)."""
    if not scheme:
        return None
    return "FP8" if _is_fp8(scheme) and not scheme.get("dynamic") else _scheme_words(scheme)


def _compressed_tensors(section: dict[str, Any]) -> QuantPlan:
    groups = section.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors: {len(groups)} config groups ({', '.join(groups) or 'none'}); "
                                "only checkpoints with one quantization scheme are supported")
    (name, group), = groups.items()
    fmt = group.get("format") or section.get("format")
    where = f"compressed-tensors config group '{name}' (format {fmt})"
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if fmt != "float-quantized" or not _is_fp8(weights):
        raise QuantizationError(f"{where}: weights {_scheme_words(weights)} are not supported; supported: "
                                "8-bit float weights (FP8, FP8_DYNAMIC, FP8_BLOCK), format float-quantized")
    if weights.get("dynamic"):
        raise QuantizationError(f"{where}: dynamic weight scales are not stored in a checkpoint")
    strategy = weights.get("strategy")
    block = tuple(weights.get("block_structure") or ()) or None
    if strategy not in ("tensor", "channel", "block") or (strategy == "block") != (block is not None):
        raise QuantizationError(f"{where}: weight strategy '{strategy}' is not supported (tensor, channel, block)")
    activations = _ct_activations(inputs, strategy, where)
    input_scale = "input_scale" if activations == "static" else None
    fmt_ = LinearFormat("fp8", strategy, activations, block_size=block, input_scale_name=input_scale)
    kv = section.get("kv_cache_scheme")
    return QuantPlan(f"compressed-tensors {_ct_scheme_name(fmt_)}", fmt_, tuple(section.get("ignore") or ()),
                     kv_cache=_scheme_words(kv) if kv else None,
                     kv_cache_fp8=bool(kv) and _is_fp8(kv) and kv.get("strategy") == "tensor" and not kv.get("dynamic"))


def _is_fp8(scheme: dict[str, Any]) -> bool:
    return scheme.get("type") == "float" and scheme.get("num_bits") == 8 and scheme.get("symmetric", True)


def _scheme_words(scheme: dict[str, Any] | None) -> str:
    if not scheme:
        return "none"
    dynamic = " dynamic" if scheme.get("dynamic") else ""
    return f"{scheme.get('num_bits')}-bit {scheme.get('type')} per {scheme.get('strategy')}{dynamic}"


def _ct_activations(inputs: dict[str, Any] | None, weight_strategy: str, where: str) -> str:
    if inputs is None:
        return "none"
    strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
    if not _is_fp8(inputs):
        raise QuantizationError(f"{where}: input activations {_scheme_words(inputs)} are not supported")
    if strategy == "tensor" and not dynamic:
        return "static"
    if strategy == "token" and dynamic:
        return "token"
    if strategy == "group" and dynamic and weight_strategy == "block":
        return "group"
    raise QuantizationError(f"{where}: input activations {_scheme_words(inputs)} are not supported (static per "
                            "tensor, dynamic per token, or dynamic per group with block weights)")


def _ct_scheme_name(fmt: LinearFormat) -> str:
    """llm-compressor's preset name of a format, where it has one."""
    names = {("tensor", "static"): "FP8", ("channel", "token"): "FP8_DYNAMIC", ("block", "group"): "FP8_BLOCK"}
    return names.get((fmt.weight_scale, fmt.activations), f"FP8 ({fmt.weight_scale} weights, {fmt.activations})")


def _block_fp8(section: dict[str, Any]) -> QuantPlan:
    block = section.get("weight_block_size")
    where = "config.json quantization_config (quant_method fp8)"
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{where}: weight_block_size {block!r} is not two positive integers; "
                                "only block-scaled FP8 checkpoints are supported with quant_method fp8")
    if section.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationError(f"{where}: activation_scheme '{section['activation_scheme']}' is not supported "
                                "with block scales (dynamic)")
    if section.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"{where}: fmt '{section['fmt']}' is not supported (e4m3)")
    fmt = LinearFormat("fp8", "block", "group", block_size=tuple(block), scale_name="weight_scale_inv")
    excluded = tuple(section.get("modules_to_not_convert") or ())
    return QuantPlan(f"fp8 block {block[0]}x{block[1]}", fmt, excluded)
