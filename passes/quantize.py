"""quantize (stage ``quantize``, after canonicalize, before fuse): linears -> ``fp8_linear`` /
``nvfp4_linear``, as the checkpoint's quantization config says (``autodeploy/quantization/readers.py``)
or as ``--quantization`` asks (online: bf16/fp16 weights quantized while they load).

- Which linears: in a quantized checkpoint, those whose weight is stored quantized (FP8, or NVFP4's
  packed bytes), checked against the producer's exclusion list; online, every linear except the LM
  head, the producer-style exclusions and weights tied to another use (the embedding).
- ``aten.linear`` -> the quantized op; ``swiglu`` -> one quantized GEMM on the stacked gate/up
  weights + ``{fp8,nvfp4}_swiglu_down`` (a quantized MLP has no unfused canonical form).
- The new parameters (named as the checkpoint names them) are filled by load hooks through one
  ``ParameterWriter`` (``ctx.artifacts["param_writer"]``), which fusion later redirects.
- MoE experts stored quantized are dequantized at load into the ``moe`` op's weights, with a warning.
- Nothing is ever ignored: a checkpoint tensor stored quantized that no linear reads, a missing or
  misshapen scale, a shape that does not split into the format's blocks stop the compile.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import fx

from autodeploy.errors import QuantizationError
from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.params import sole_parameter
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage
from autodeploy.quantization.graph import (
    add_quant_params,
    quant_linear_args,
    quant_linear_node,
    redirect_stacked,
    remove_params,
    stack_quant_linears,
)
from autodeploy.quantization.kv_cache import resolve_kv_cache
from autodeploy.quantization.loading import register_quant_hooks, register_targets
from autodeploy.quantization.params import ParameterWriter, QuantLinear
from autodeploy.quantization.readers import read_quant_plan
from autodeploy.quantization.scheme import QuantPlan, QuantSummary
from autodeploy.quantization.source import QUANTIZED_DTYPES, choose_quantized_source, stored_tensors
from autodeploy.transforms.fuse_gate_up import halves_of_one_weight

log = logging.getLogger("autodeploy.quantize")
aten = torch.ops.aten
SWIGLU = torch.ops.autodeploy.swiglu.default
MOE = torch.ops.autodeploy.moe.default
SWIGLU_DOWN = {"fp8": torch.ops.autodeploy.fp8_swiglu_down.default,
               "nvfp4": torch.ops.autodeploy.nvfp4_swiglu_down.default}


class Quantize(Pass):
    name = "quantize"
    stage = Stage.QUANTIZE
    ensures = ("quantized",)

    def apply(self, ctx: CompileContext) -> PassResult:
        checkpoint = ctx.checkpoint
        plan = read_quant_plan(checkpoint.path if checkpoint else None, ctx.config.quantization)
        stored = stored_tensors(checkpoint) if checkpoint and ctx.config.weights == "checkpoint" else {}
        if plan is None:
            _refuse_undeclared(stored)
            return PassResult(0, "the checkpoint is not quantized")
        summary = _Quantizer(ctx, plan, stored).run()
        if not summary.quantized:
            raise QuantizationError(f"{plan.method}: no linear layer of this model can be quantized (its "
                                    "projections are not aten.linear with a weight of their own, e.g. GPT-2's Conv1D)")
        ctx.artifacts["quantization"] = summary
        for line in summary.lines():
            log.info("%s", line)
        return PassResult(len(summary.quantized), f"{summary.method}: {len(summary.quantized)} linears quantized")


def _refuse_undeclared(stored: dict) -> None:
    fp8 = sorted(n for n, (dtype, _) in stored.items() if dtype == QUANTIZED_DTYPES["fp8"])
    if fp8:
        raise QuantizationError(f"the checkpoint stores {len(fp8)} FP8 tensors (e.g. {fp8[0]}) but declares no "
                                "quantization (no quantization_config in config.json, no hf_quant_config.json)")


class _Quantizer:
    """One application of a plan to a graph."""

    def __init__(self, ctx: CompileContext, plan: QuantPlan, stored: dict):
        self.ctx, self.gm, self.plan, self.stored = ctx, ctx.gm, plan, stored
        self.writer = ctx.artifacts.setdefault("param_writer", ParameterWriter(ctx.gm, ctx.device))
        self.writer.online = plan.format.kind if plan.online else None
        self.linears: list[QuantLinear] = []  # each as the checkpoint stores it (before any stacking)
        self.unquantized: list[str] = []
        self.stacked: list[QuantLinear] = []  # parts of stacked gate/up GEMMs (parameters removed at the end)
        self.kept_dense = _output_linear_modules(ctx.gm) | _router_modules(ctx.gm)  # never quantized online

    def run(self) -> QuantSummary:
        for node in list(self.gm.graph.find_nodes(op="call_function", target=aten.linear.default)):
            self._linear(node)
        for node in list(self.gm.graph.find_nodes(op="call_function", target=SWIGLU)):
            self._swiglu(node)
        dequantized = self._experts()
        self.gm.graph.eliminate_dead_code()
        remove_params(self.gm, self.stacked)
        self.gm.recompile()
        if self.plan.online or self.ctx.config.weights != "random":
            register_quant_hooks(self.ctx, self.plan, self.linears, self.writer, self.stored)
            register_targets(self.ctx, self.writer)
        # else: random weights in a checkpoint's stored format: no tensors arrive for the hooks to place, and
        # load_weights makes the quantized parameters themselves random (codes, unit scales)
        return QuantSummary(self.plan.method, self.plan.format.describe(),
                            tuple(q.module for q in self.linears), tuple(self.unquantized), self.plan.excluded,
                            tuple(sorted(dequantized)), self._kv_line())

    # -- which modules ------------------------------------------------------------------------------

    def _module(self, weight) -> str | None:
        """The linear module whose ``.weight`` parameter ``weight`` reads, if it is quantized."""
        name = weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" else None
        if name is None or not name.endswith(".weight"):
            return None
        module = name[: -len(".weight")]
        if self._quantized(module, weight):
            return module
        self.unquantized.append(module)
        return None

    def _quantized(self, module: str, weight: fx.Node) -> bool:
        excluded = self.plan.is_excluded(module)
        if self.stored and not self.plan.online:
            stored = self.stored.get(f"{module}.weight", ("", ()))[0] == QUANTIZED_DTYPES[self.plan.format.kind]
            if stored and excluded:
                raise QuantizationError(f"{self.plan.method}: {module}.weight is stored quantized, but the "
                                        f"checkpoint's exclusion list ({', '.join(self.plan.excluded)}) names it")
            if stored and sole_parameter(weight) is None:
                raise QuantizationError(f"{self.plan.method}: {module}.weight is stored quantized but is also "
                                        "read elsewhere (tied to the embedding?)")
            return stored
        return not excluded and module not in self.kept_dense and sole_parameter(weight) is not None

    def _quant_linear(self, module: str, weight: fx.Node) -> QuantLinear:
        n, k = weight.meta["val"].shape
        linear = QuantLinear(module, self.plan.format, int(n), int(k))
        linear.check_shape(self.plan.method)
        self.linears.append(linear)
        add_quant_params(self.gm, self.writer, linear)
        return linear

    # -- rewrites -----------------------------------------------------------------------------------

    def _linear(self, node: fx.Node) -> None:
        x, weight, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        module = self._module(weight) if weight.meta["val"].dim() == 2 else None
        if module is None:
            return
        new = quant_linear_node(self.gm, self._quant_linear(module, weight), x, bias, before=node)
        self._replace(node, [new], new)

    def _swiglu(self, node: fx.Node) -> None:
        x, w_gate, w_up, w_down, *activation = node.args
        stacked = halves_of_one_weight(w_gate, w_up)
        weights = [stacked] if stacked is not None else [w_gate, w_up]
        modules = [self._module(w) for w in (*weights, w_down)]
        if not any(modules):
            return
        if not all(modules):
            raise QuantizationError(f"{self.plan.method}: the gated MLP {node.name} mixes quantized and "
                                    f"unquantized projections ({', '.join(m or '?' for m in modules)})")
        parts = [self._quant_linear(m, w) for m, w in zip(modules, (*weights, w_down))]
        gate_up = parts[0]
        if stacked is None:
            gate_up = stack_quant_linears(self.gm, parts[:2])
            redirect_stacked(self.writer, gate_up, parts[:2])
            self.stacked.extend(parts[:2])
        first = quant_linear_node(self.gm, gate_up, x, None, before=node)
        _, down_args = quant_linear_args(self.gm, parts[-1], first, None, before=node)
        with self.gm.graph.inserting_before(node):
            fused = self.gm.graph.call_function(SWIGLU_DOWN[self.plan.format.kind], (*down_args, *activation))
        self._replace(node, [first, fused], fused)

    def _replace(self, node: fx.Node, new_nodes: list[fx.Node], result: fx.Node) -> None:
        propagate_meta(self.gm, new_nodes)
        for new in new_nodes:
            new.meta["autodeploy_provenance"] = "quantize"
        node.replace_all_uses_with(result)
        self.gm.graph.erase_node(node)

    # -- MoE experts, leftovers, report -------------------------------------------------------------

    def _experts(self) -> set[str]:
        """Stored-quantized modules no linear reads: MoE experts (dequantized at load) or an error."""
        kept = {q.name(r) for q in self.linears for r in q.roles()}
        dtype = QUANTIZED_DTYPES[self.plan.format.kind]
        left = {n[: -len(".weight")] for n, (d, _) in self.stored.items()
                if d == dtype and n.endswith(".weight") and n not in kept}
        has_moe = bool(self.gm.graph.find_nodes(op="call_function", target=MOE))
        experts = {m for m in left if has_moe and ".experts." in m}
        if left - experts:
            example = sorted(left - experts)[0]
            raise QuantizationError(f"{self.plan.method}: {example}.weight is stored quantized but no linear "
                                    "layer of the graph reads it; autodeploy cannot compute it")
        if has_moe and (experts or self.plan.online):
            log.warning("%s: MoE experts run in %s: %s", self.plan.method, self.ctx.dtype,
                        "dequantized while loading (no quantized MoE op yet)" if experts
                        else "online quantization covers linear layers, not the moe op")
        if self.stored and not self.plan.online:
            self.ctx.artifacts["weight_source"] = functools.partial(
                choose_quantized_source, fmt=self.plan.format, kept=kept, dequantized=experts)
        return experts

    def _kv_line(self) -> str:
        """The KV cache's dtype as ``insert_kv_cache`` will choose it (an unsupported KV scheme stops here)."""
        return resolve_kv_cache(self.ctx.config.kv_cache_dtype, self.plan, self.ctx.dtype).describe()


def _output_linear_modules(gm: fx.GraphModule) -> set[str]:
    """Modules of the linears whose result reaches the graph output through single-input ops (the LM
    head, whatever its name)."""
    out, frontier = set(), list(gm.graph.output_node().all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node.op != "call_function":
            continue
        if node.target == aten.linear.default:
            weight = node.args[1]
            if isinstance(weight, fx.Node) and weight.op == "get_attr":
                out.add(str(weight.target).rpartition(".")[0])
            continue
        tensors = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if len(tensors) == 1:
            frontier.append(tensors[0])
    return out


def _router_modules(gm: fx.GraphModule) -> set[str]:
    """Modules of the MoE routers: linears that the routing operands of a ``moe`` op come from
    (without passing through its token input). Producers leave them unquantized; so does online."""
    out = set()
    for moe in gm.graph.find_nodes(op="call_function", target=MOE):
        stop = _ancestors(moe.args[0]) | {moe.args[0]}
        frontier, seen = [moe.args[1], moe.args[2]], set()
        while frontier:
            node = frontier.pop()
            if not isinstance(node, fx.Node) or node in seen or node in stop:
                continue
            seen.add(node)
            if node.target == aten.linear.default and node.args[1].op == "get_attr":
                out.add(str(node.args[1].target).rpartition(".")[0])
                continue
            frontier.extend(node.all_input_nodes)
    return out


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, frontier = set(), [node]
    while frontier:
        for parent in frontier.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                frontier.append(parent)
    return seen
