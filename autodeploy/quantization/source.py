"""What a quantized checkpoint stores (read from the safetensors headers, no tensor data), and the
weight source for quantized checkpoints whose MoE experts are dequantized while loading.

``autodeploy::moe`` takes stacked bf16/fp16/fp32 expert weights; a checkpoint that quantizes its
experts (one FP8/NVFP4 tensor per expert and projection) is loaded by dequantizing each expert's
weight and handing the result to transformers' own weight conversions (which stack the experts),
while the tensors of the linears the graph keeps quantized stream straight from the files. The
``quantize`` pass says so loudly: the experts then cost bf16 memory and bandwidth.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Iterator

import torch

from ..model_loading import Checkpoint, SafetensorsSource, Slices, WeightSource
from .numerics import dequantize_fp8, dequantize_nvfp4
from .scheme import LinearFormat

# tensors that only describe quantization (scales of weights, activations, the KV cache)
SCALE_LEAVES = frozenset({"weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale",
                          "k_scale", "v_scale", "q_scale", "output_scale"})
QUANTIZED_DTYPES = {"fp8": "F8_E4M3", "nvfp4": "U8"}


def stored_tensors(checkpoint: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint's safetensors files: name -> (safetensors dtype, shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in checkpoint.weight_files:
        if file.suffix != ".safetensors":
            continue
        for name, info in _header(file).items():
            if name != "__metadata__":
                out[name] = (info["dtype"], tuple(info["shape"]))
    return out


def _header(file: Path) -> dict:
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def dequantize_module(fmt: LinearFormat, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weight of one quantized module from its stored tensors (by leaf name)."""
    if fmt.kind == "nvfp4":
        return dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"].reshape(()))
    scale = tensors[fmt.scale_name].float()
    block = fmt.block_size if fmt.weight_scale == "block" else None
    scale = scale if block else scale.reshape(-1) if scale.numel() > 1 else scale.reshape(())
    return dequantize_fp8(tensors["weight"], scale, block)


def choose_quantized_source(checkpoint: Checkpoint, needed: set[str], dtype: torch.dtype, slices: Slices | None = None,
                            *, fmt: LinearFormat, kept: set[str], dequantized: set[str]) -> WeightSource:
    """``choose_weight_source`` for a quantized checkpoint: the files as they are when they hold
    every tensor under its own name and nothing is dequantized, else a :class:`DequantizingSource`
    (never transformers' loader alone, which would drop the scales of formats it does not know).
    ``slices`` (tensor parallelism): each tensor named there is cut to this rank's part, from the
    file where it streams from one (only the part is read), else after transformers built it."""
    direct = SafetensorsSource(checkpoint.weight_files, slices)
    stored = direct.names()
    if not dequantized:
        aliases = {name: twin for name in needed - stored if (twin := _tied_twins(checkpoint).get(name)) in stored}
        if needed <= stored | set(aliases) and not set(aliases) & set(slices or {}):
            return AliasingSource(direct, aliases)
    return DequantizingSource(checkpoint, fmt, kept, dequantized, dtype, slices)


def _tied_twins(checkpoint: Checkpoint) -> dict[str, str]:
    """Parameter name -> another name of the same (tied) parameter, from the model on meta."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_plain_config(checkpoint.config))
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {name: other for names in by_tensor.values() for name in names for other in names if other != name}


class AliasingSource(WeightSource):
    """The files as they are, each tied tensor also under the names of its twins (a tied LM head)."""

    def __init__(self, direct: SafetensorsSource, aliases: dict[str, str]):
        self.direct, self.aliases = direct, aliases

    def names(self) -> set[str]:
        return self.direct.names() | set(self.aliases)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        twins: dict[str, list[str]] = {}
        for alias, stored in self.aliases.items():
            twins.setdefault(stored, []).append(alias)
        for name, tensor in self.direct:
            yield name, tensor
            for alias in twins.get(name, ()):
                yield alias, tensor


def _plain_config(config):
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # what is handed to transformers holds plain tensors
    return config


class DequantizingSource(WeightSource):
    """``kept`` tensors straight from the files; every other tensor through transformers, with the
    weights of the ``dequantized`` modules dequantized to ``dtype`` first (module doc)."""

    def __init__(self, checkpoint: Checkpoint, fmt: LinearFormat, kept: set[str], dequantized: set[str],
                 dtype: torch.dtype, slices: Slices | None = None):
        self.checkpoint, self.fmt, self.kept, self.dequantized, self.dtype = checkpoint, fmt, kept, dequantized, dtype
        self.direct = SafetensorsSource(checkpoint.weight_files)
        self.slices = slices or {}

    def names(self) -> set[str]:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_plain_config(self.checkpoint.config))
        return set(self.kept) | set(model.state_dict())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from SafetensorsSource(self.checkpoint.weight_files, self.slices, only=self.kept)
        state = self.model().state_dict()
        for name, tensor in state.items():
            if name not in self.kept:
                yield name, self.slices[name](tensor) if name in self.slices else tensor

    def model(self) -> torch.nn.Module:
        """The HF model of every tensor but the ``kept`` ones, the ``dequantized`` modules'
        weights dequantized (with every quantized module dequantized: the dequantized reference)."""
        rest: dict[str, torch.Tensor] = {}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.direct:
            module, _, leaf = name.rpartition(".")
            if name in self.kept:
                continue
            if module in self.dequantized:
                pending.setdefault(module, {})[leaf] = tensor
            elif leaf not in SCALE_LEAVES:
                rest[name] = tensor
        for module, tensors in pending.items():
            rest[f"{module}.weight"] = dequantize_module(self.fmt, tensors).to(self.dtype)
        return self._model(rest)

    def _model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The HF model from ``state`` in the checkpoint's naming (transformers renames and stacks,
        e.g. per-expert weights into one tensor). One host copy of those weights."""
        from transformers import AutoModelForCausalLM

        from transformers.utils import logging as hf_logging

        config = _plain_config(self.checkpoint.config)
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report would list the kept (quantized) weights as missing
        try:
            return model_class.from_pretrained(None, config=config, state_dict=state, dtype=self.dtype).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
