"""HF eager models that compute what a compiled quantized model computes (the canary's reference).

- A checkpoint transformers runs as its producer meant on the CPU (compressed-tensors, with the
  ``compressed-tensors`` package installed: weights dequantized and activations fake-quantized by
  the producer's own code): transformers' model, as for any checkpoint.
- Any other quantized checkpoint (ModelOpt, which transformers does not read, and block FP8, which
  transformers only dequantizes on the CPU): the HF model on the dequantized weights
  (``numerics``), with every quantized linear's input fake-quantized as the format says.
- ``--quantization``: the HF model with each quantized linear's weight replaced by its quantized
  value and its input fake-quantized (what online quantization computes).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..model_loading import open_checkpoint
from .numerics import fake_quantize_activations
from .readers import ONLINE_FORMATS, read_quant_plan
from .scheme import LinearFormat
from .source import QUANTIZED_DTYPES, DequantizingSource, dequantize_module, stored_tensors


def _hf_eager(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """HF's own torch code: eager attention, no hub kernels (transformers 5.25 defaults to them for
    Mamba-2 layers, and they are neither the reference nor reachable offline)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                use_kernels=False).eval()


def reference_model(model_dir: Path, dtype: torch.dtype, quantization: str | None = None) -> torch.nn.Module:
    plan = read_quant_plan(model_dir, quantization)
    if plan is None or (plan.method.startswith("compressed-tensors") and _has_compressed_tensors()):
        return _hf_eager(model_dir, dtype)
    if plan.online:
        model = _hf_eager(model_dir, dtype)
        quantize_linears_like_online(model, ONLINE_FORMATS[quantization])
        return model
    return dequantized_model(model_dir, dtype, plan.format)


def _has_compressed_tensors() -> bool:
    return importlib.util.find_spec("compressed_tensors") is not None


def dequantized_model(model_dir: Path, dtype: torch.dtype, fmt: LinearFormat) -> torch.nn.Module:
    """The HF model on the checkpoint's dequantized weights, quantized linears' inputs fake-quantized."""
    checkpoint = open_checkpoint(model_dir)
    stored = stored_tensors(checkpoint)
    quantized = {n[: -len(".weight")] for n, (d, _) in stored.items()
                 if n.endswith(".weight") and d == QUANTIZED_DTYPES[fmt.kind]}
    model = DequantizingSource(checkpoint, fmt, set(), quantized, dtype).model()
    model.config._attn_implementation = "eager"
    scales = _input_scales(checkpoint, quantized) if fmt.activations == "static" else {}
    for name, module in model.named_modules():
        if name in quantized and isinstance(module, torch.nn.Linear):
            _fake_quantize_inputs(module, fmt, scales.get(name))
    return model


def quantize_linears_like_online(model: torch.nn.Module, fmt: LinearFormat) -> None:
    """Every linear but the output embedding (and weights tied to it) quantized as online."""
    from .numerics import quantize_fp8_per_channel, quantize_nvfp4

    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head or module.weight is getattr(head, "weight", None):
            continue
        with torch.no_grad():
            if fmt.kind == "nvfp4":
                packed, scale, scale_2 = quantize_nvfp4(module.weight)
                tensors = {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2}
            else:
                weight, scale = quantize_fp8_per_channel(module.weight)
                tensors = {"weight": weight, fmt.scale_name: scale}
            module.weight.copy_(dequantize_module(fmt, tensors))
        _fake_quantize_inputs(module, fmt, None)


def _input_scales(checkpoint, modules: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in checkpoint.weight_files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                module, _, leaf = key.rpartition(".")
                if leaf == "input_scale" and module in modules:
                    out[module] = handle.get_tensor(key).float().reshape(())
    return out


def _fake_quantize_inputs(module: torch.nn.Module, fmt: LinearFormat, input_scale: torch.Tensor | None) -> None:
    if fmt.activations == "none":
        return

    def hook(_module, args):
        x = args[0]
        return (fake_quantize_activations(x, fmt.activations, input_scale, fmt.group_size).to(x.dtype), *args[1:])

    module.register_forward_pre_hook(hook)
