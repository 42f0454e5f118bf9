"""Fusion passes (stage ``fuse``): fewer, larger kernels. Each is switchable in the pipeline YAML.

- ``fuse_qkv``: sibling linears on one input -> one GEMM + slices (``transforms/fuse_qkv.py``);
- ``fuse_gate_up``: ``swiglu`` -> one gate/up GEMM + ``swiglu_down`` (``transforms/fuse_gate_up.py``);
- ``fuse_add_rms_norm``: residual add + RMSNorm -> one kernel, and RMSNorm reading bf16/fp16
  directly instead of an fp32 copy (``transforms/fuse_add_rms_norm.py``);
- ``fuse_rope_qk``: the q and k rotations of an attention in one launch (``transforms/fuse_rope_qk.py``);
- ``fuse_norm_linear``: an RMSNorm read only by one linear -> one op, a single GEMV kernel for decode
  steps of a few tokens (``transforms/fuse_norm_linear.py``);
- ``decode_linear``: the remaining linears (attention output, LM head) -> ``autodeploy::linear``, the
  same GEMV at one row (``transforms/decode_linear.py``).

The two GEMM fusions create stacked parameters on meta and register a load hook per checkpoint
tensor that copies it into its rows of the stacked parameter on the device (allocated when the
first piece arrives): weights stream once, no second copy exists, host memory stays at one tensor.
They leave alone weights that an earlier pass (sharding, quantization) already hooks; quantized
linears (``fp8_linear`` / ``nvfp4_linear``) fuse too, their load hooks redirected into the rows of
the stacked parameters through the quantize pass's ``ParameterWriter``.
"""

from __future__ import annotations

import torch
from torch import fx

from autodeploy.export import get_tensor_attr
from autodeploy.graph.params import FusedParameter
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage
from autodeploy.quantization.graph import redirect_stacked
from autodeploy.quantization.loading import register_targets
from autodeploy.transforms.decode_linear import use_decode_linear
from autodeploy.transforms.fuse_add_rms_norm import fold_norm_input_casts, fuse_add_rms_norm
from autodeploy.transforms.fuse_gate_up import fuse_gate_up
from autodeploy.transforms.fuse_norm_linear import fuse_norm_linear
from autodeploy.transforms.fuse_qkv import fuse_sibling_linears, fuse_sibling_quant_linears
from autodeploy.transforms.fuse_rope_qk import fuse_rope_qk

from .load_weights import set_tensor_attr_replace


class StackedParameterLoader:
    """Load hooks of one stacked parameter: each checkpoint tensor lands in its rows."""

    def __init__(self, gm: fx.GraphModule, fused: FusedParameter, device: torch.device):
        self.gm, self.fused, self.device = gm, fused, device
        self.missing = {name for name, _, _ in fused.pieces}

    def register(self, ctx: CompileContext) -> None:
        for name, start, end in self.fused.pieces:
            ctx.add_weight_hook(name, self._hook(name, start, end))
        ctx.hook_targets[self.fused.name] = lambda: not self.missing

    def _hook(self, name: str, start: int, end: int):
        def copy_rows(tensor: torch.Tensor) -> None:
            target = self._target()
            if tuple(tensor.shape) != tuple(target[start:end].shape):
                raise RuntimeError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                   f"rows {start}:{end} of {self.fused.name} {tuple(target.shape)}")
            target[start:end].copy_(tensor)  # host -> device and dtype cast in one copy
            self.missing.discard(name)

        return copy_rows

    def _target(self) -> torch.Tensor:
        current = get_tensor_attr(self.gm, self.fused.name)
        if current.device.type == "meta":
            current = torch.empty(self.fused.shape, dtype=self.fused.dtype, device=self.device)
            set_tensor_attr_replace(self.gm, self.fused.name, current, is_param=True)
        return current


def _unhooked(ctx: CompileContext):
    return lambda name: name not in ctx.weight_hooks


def _register(ctx: CompileContext, fused: list[FusedParameter]) -> None:
    for info in fused:
        StackedParameterLoader(ctx.gm, info, ctx.device).register(ctx)


class FuseQKV(Pass):
    name = "fuse_qkv"
    stage = Stage.FUSE
    ensures = ("qkv_fused",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result, fused = fuse_sibling_linears(ctx.gm, _unhooked(ctx))
        _register(ctx, fused)
        quantized, stacked, biases = fuse_sibling_quant_linears(ctx.gm)
        _register(ctx, biases)
        if stacked:  # the quantize pass's writer places each part's tensors in its rows
            writer = ctx.artifacts["param_writer"]
            for linear in stacked:
                redirect_stacked(writer, linear.fused, list(linear.parts))
            register_targets(ctx, writer)
        matches = result.matches + quantized.matches
        return PassResult(matches, f"{result.matches} linear groups -> {len(fused)} stacked parameters, "
                                   f"{quantized.matches} quantized groups")


class FuseGateUp(Pass):
    name = "fuse_gate_up"
    stage = Stage.FUSE
    requires = ("mlp_canonical",)
    ensures = ("gate_up_fused",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result, fused = fuse_gate_up(ctx.gm, _unhooked(ctx))
        _register(ctx, fused)
        return PassResult(result.matches, f"{result.matches} gated MLPs, {result.rejected} left separate")


class FuseAddRMSNorm(Pass):
    name = "fuse_add_rms_norm"
    stage = Stage.FUSE
    requires = ("norms_canonical",)
    ensures = ("add_rms_norm_fused",)

    def apply(self, ctx: CompileContext) -> PassResult:
        fused = fuse_add_rms_norm(ctx.gm)
        folded = fold_norm_input_casts(ctx.gm)
        return PassResult(fused.matches, f"{fused.matches} add+norm fused, {folded.matches} norm input casts folded")


class FuseRoPEQK(Pass):
    name = "fuse_rope_qk"
    stage = Stage.FUSE
    requires = ("rope_canonical", "attention_canonical")
    ensures = ("rope_qk_fused",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result = fuse_rope_qk(ctx.gm)
        return PassResult(result.matches, f"{result.matches} q/k rotation pairs, {result.rejected} left apart")


class FuseNormLinear(Pass):
    name = "fuse_norm_linear"
    stage = Stage.FUSE
    requires = ("norms_canonical",)
    ensures = ("norm_linear_fused",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result = fuse_norm_linear(ctx.gm)
        return PassResult(result.matches, f"{result.matches} norms folded into their linear, {result.rejected} left")


class DecodeLinear(Pass):
    name = "decode_linear"
    stage = Stage.FUSE
    ensures = ("decode_linear",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result = use_decode_linear(ctx.gm)
        return PassResult(result.matches, f"{result.matches} linears take the GEMV at one row")
