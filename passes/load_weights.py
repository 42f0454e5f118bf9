"""load_weights: materialize every parameter and buffer on the target device.

Checkpoint tensors stream one at a time, each cut to this rank's slice first where sharding
registered one (``ctx.weight_slices``: only the slice is read); a tensor with registered load hooks
(fusion, quantization) goes to its hooks, any other is copied into the parameter of the same name. A
parameter that hooks build (``ctx.hook_targets``, e.g. a fused GEMM weight) is not looked up in the
checkpoint; it counts as loaded once its hooks report every piece delivered. With
    def _stream(self, ctx: CompileContext, pending: dict[str, bool], source) -> int:
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from tqdm import tqdm

from autodeploy.export import get_tensor_attr, set_tensor_attr
from autodeploy.model_loading import RandomSource, choose_weight_source
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage

log = logging.getLogger("autodeploy.load_weights")
_QUANT_SCALES = {"weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale"}


class LoadWeightsConfig(PassConfig):
    random_std: float = 0.02
    progress: bool = False


class LoadWeights(Pass):
    name = "load_weights"
    stage = Stage.LOAD_WEIGHTS
    ensures = ("weights_loaded",)
    Config = LoadWeightsConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        pending = _meta_tensors(ctx.gm)
        loaded = self._load_buffers(ctx, pending)
        needed = (set(pending) - set(ctx.hook_targets)) | set(ctx.weight_hooks)  # hook targets are built, not read
        if ctx.config.weights == "random":
            exported = ctx.artifacts.get("exported_parameters", {})
            # a parameter the quantize pass replaced in a checkpoint's stored format (FP8 codes, packed NVFP4) is
            # made in its own dtype and shape by _fill_random, not from the exported one
            shapes = {n: exported[n] for n in needed
                      if n in exported and not (n in pending and _dtype_of(ctx.gm, n) in _STORED_QUANTIZED)}
            source = RandomSource(shapes, ctx.device, self.config.random_std, ctx.weight_slices)
            loaded += self._stream(ctx, pending, source) + self._fill_random(ctx, pending)
        else:
            choose = ctx.artifacts.get("weight_source", choose_weight_source)
            loaded += self._stream(ctx, pending, choose(ctx.checkpoint, needed, ctx.dtype, ctx.weight_slices))
        if pending:
            missing = ", ".join(sorted(pending)[:8])
            raise RuntimeError(f"{len(pending)} parameter(s) have no weights in the checkpoint: {missing}")
        _move_rest(ctx.gm, ctx.device)
        retarget_devices(ctx.gm, ctx.device)
        return PassResult(loaded, f"{loaded} tensors on {ctx.device}")

    def _load_buffers(self, ctx: CompileContext, pending: dict[str, bool]) -> int:
        count = 0
        for name, value in ctx.buffers.items():
            if name in pending:
                _assign(ctx.gm, name, value, pending.pop(name), ctx.device)
                count += 1
        return count

    def _fill_random(self, ctx: CompileContext, pending: dict[str, bool]) -> int:
        generator = torch.Generator(device=ctx.device).manual_seed(0)
        count = len(pending)
        for name in list(pending):
            meta = get_tensor_attr(ctx.gm, name)
            value = _random_value(meta, name, ctx.device, self.config.random_std, generator)
            _assign(ctx.gm, name, value, pending.pop(name), ctx.device)
        return count

    def _stream(self, ctx: CompileContext, pending: dict[str, bool], source) -> int:
        count, unexpected = 0, []
        items = tqdm(source, desc="loading weights", unit="tensor", disable=not self.config.progress)
        for name, tensor in items:
            if name in ctx.weight_hooks:
                for hook in ctx.weight_hooks[name]:
                    hook(tensor)
            elif name in pending:
                _assign(ctx.gm, name, tensor, pending.pop(name), ctx.device)
            else:
                unexpected.append(name)
                continue
            count += 1
        if unexpected:
            log.info("ignored %d checkpoint tensors not used by the graph (e.g. %s)", len(unexpected), unexpected[0])
        for name, complete in ctx.hook_targets.items():
            if name in pending and complete():
                pending.pop(name)
        return count


def _random_value(meta: torch.Tensor, name: str, device, std: float, generator) -> torch.Tensor:
    """Normal matrices, ones for vectors and quantization scales; packed NVFP4 codes random bytes."""
    if meta.dtype == torch.uint8:
        return torch.randint(0, 256, meta.shape, dtype=torch.uint8, device=device, generator=generator)
    if meta.dim() < 2 or name.rpartition(".")[2] in _QUANT_SCALES:
        return torch.ones(meta.shape, dtype=meta.dtype, device=device)
    if meta.dtype == torch.float8_e4m3fn:  # no normal_ in fp8: drawn in fp32, rounded
        value = torch.empty(meta.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator)
        return value.to(meta.dtype)
    return torch.empty(meta.shape, dtype=meta.dtype, device=device).normal_(0.0, std, generator=generator)


_STORED_QUANTIZED = (torch.float8_e4m3fn, torch.uint8)  # FP8 codes, packed NVFP4


def _dtype_of(gm: fx.GraphModule, name: str) -> torch.dtype:
    return get_tensor_attr(gm, name).dtype


def _meta_tensors(gm: fx.GraphModule) -> dict[str, bool]:
    """Names of tensors still on meta -> whether each is a parameter."""
    used = {n.target for n in gm.graph.find_nodes(op="get_attr")}
    out = {name: True for name, p in gm.named_parameters() if p.device.type == "meta" and name in used}
    out.update({name: False for name, b in gm.named_buffers() if b.device.type == "meta" and name in used})
    return out


def _assign(gm: fx.GraphModule, name: str, value: torch.Tensor, is_param: bool, device: torch.device) -> None:
    meta = get_tensor_attr(gm, name)
    if tuple(meta.shape) != tuple(value.shape):
        raise RuntimeError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(meta.shape)}")
    value = value.to(device=device, dtype=meta.dtype if meta.dtype.is_floating_point else value.dtype)
    set_tensor_attr_replace(gm, name, value, is_param)


def set_tensor_attr_replace(gm: fx.GraphModule, name: str, value: torch.Tensor, is_param: bool) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = gm.get_submodule(module_name) if module_name else gm
    if is_param:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        set_tensor_attr(gm, name, value, as_parameter=False)


def _move_rest(gm: fx.GraphModule, device: torch.device) -> None:
    for name, buf in list(gm.named_buffers()):
        if buf.device != device and buf.device.type != "meta":
            set_tensor_attr_replace(gm, name, buf.to(device), is_param=False)


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Point ``device=`` arguments of factory ops (traced on the CPU) at the target device."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": device}
        if node.target == torch.ops.aten.to.device:
            node.args = (node.args[0], device, *node.args[2:])
    gm.recompile()
