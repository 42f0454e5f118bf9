"""Capture an unmodified HF causal LM with ``torch.export`` in the flattened token layout.

The exported function is ``logits[T, V] = f(input_ids[T], position_ids[T])``: every token of a step
in one dynamic dimension, positions explicit. The result is an ``fx.GraphModule`` whose
parameters and buffers keep their HF names (``model.layers.0.self_attn.q_proj.weight``) as meta
tensors, and whose nodes carry fake-tensor metadata (``meta["val"]``).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.overrides import TorchFunctionMode

from .errors import ExportError
from .graph.cleanup import cleanup_graph
from .hf_linear_attention import provide_gated_delta_rule

log = logging.getLogger("autodeploy.export")

EXAMPLE_TOKENS = 8
_WRAPPER_PREFIX = "model."


class FlatTokens(torch.nn.Module):
    """Presents an HF causal LM as ``logits = f(input_ids[T], position_ids[T])``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with _SkipRedundantGradModeSets():
            out = self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False)
        return out.logits[0]


class _SkipRedundantGradModeSets(TorchFunctionMode):
    """Drops ``torch._C._set_grad_enabled(mode)`` calls that set the mode grad already has.

    HF code decorates e.g. the rotary embedding with ``@torch.no_grad()``. Under our ambient no_grad its
    enter and exit change nothing, yet export records both, and a recorded grad-mode node makes export
    split the whole graph around it and inline it back (~20% of a 32-layer export). Entered inside the
    traced function, this mode sees the call before export's own mode; a real change passes through.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._set_grad_enabled and bool(args[0]) == torch.is_grad_enabled():
            return None
        return func(*args, **(kwargs or {}))


def export_model(model: torch.nn.Module) -> fx.GraphModule:
    """Export ``model`` (built on meta) with a dynamic token dimension. While it runs, Gated DeltaNet
    layers compute our gated delta rule (``hf_linear_attention``: through transformers' kernel seam where
    the layers have it; else the one patch, the function's name rebound for the export).

    Parameters are traced as fake CPU tensors rather than meta tensors so that constants the model
    creates while running (e.g. ``torch.tensor(0.0)`` in mask code) keep their real values.
    """
    _fakeify(model, FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()))
    # Dim.DYNAMIC, not a range: with a range (1 .. 2^20) export proves every guard over it and rejects
    # what holds only for shorter steps: MPT slices its ALiBi bias, built for its max_seq_len, to the
    # step's token count (T == 2048 - max(0, 2048 - T): T <= 2048), and torch 2.11 could not prove
    # min(16*T, 32*T) == 16*T. Such position-only subgraphs (ALiBi, masks) are evaluated per length and
    # replaced by canonicalization. A specialization to one count still fails the export (Dim.DYNAMIC).
    num_tokens = Dim.DYNAMIC
    input_ids = torch.zeros(EXAMPLE_TOKENS, dtype=torch.int64)
    position_ids = torch.arange(EXAMPLE_TOKENS, dtype=torch.int64)
    start = time.perf_counter()
    try:
        with torch.no_grad(), provide_gated_delta_rule(model):
            program = torch.export.export(
                FlatTokens(model),
                (input_ids, position_ids),
                dynamic_shapes=({0: num_tokens}, {0: num_tokens}),
                strict=False,
            )
    except Exception as exc:
        raise ExportError(
            f"torch.export failed for {type(model).__name__}: {type(exc).__name__}: {exc}".strip()
        ) from exc
    _refuse_state_writes(program, model)
    gm = graph_module_from_program(program)
    log.info("exported %s in %.1f s (%d nodes)", type(model).__name__, time.perf_counter() - start, len(gm.graph.nodes))
    return gm


def _refuse_state_writes(program: ExportedProgram, model: torch.nn.Module) -> None:
    """A parameter or buffer the forward writes is state kept from one call to the next (a cache, a
    recurrent state): each engine step would start from what the previous step left, not from its own
    sequence's. Export keeps such writes as in-place ops on the lifted input (or lists them)."""
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    written = set(program.graph_signature.buffers_to_mutate.values())
    for node in program.graph_module.graph.nodes:
        for arg in _written_arguments(node):
            spec = specs.get(_alias_base(arg).name)
            if spec is not None and spec.kind in (InputKind.BUFFER, InputKind.PARAMETER):
                written.add(spec.target)
    if written:
        names = ", ".join(sorted(_strip_prefix(name) for name in written))
        raise ExportError(
            f"{type(model).__name__} writes to {names} during its forward: state carried from one call to the "
            "next, which autodeploy does not cache per sequence (only attention's keys and values); "
            "this architecture is not supported"
        )


def _written_arguments(node: fx.Node) -> list[fx.Node]:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            written.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
    return written


def _alias_base(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view (or in-place result) of: follow ops that return an alias of their input."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        node = node.args[0]
    return node


def _fakeify(model: torch.nn.Module, mode: FakeTensorMode) -> None:
    cpu = torch.device("cpu")
    to_fake = mode.fake_tensor_converter.from_meta_and_device
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                module._parameters[key] = torch.nn.Parameter(to_fake(mode, param.to("meta"), cpu), requires_grad=False)
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = to_fake(mode, buf.to("meta"), cpu)


def graph_module_from_program(program: ExportedProgram) -> fx.GraphModule:
    """A GraphModule whose params/buffers are attributes under their HF names (get_attr nodes).

    It regenerates its Python code lazily (torch's ``_LazyGraphModule``, as Inductor's passes use):
    ``recompile()`` only marks the code stale and the next call or ``.code`` regenerates it. Passes
    recompile after every rewrite, and each real regeneration of a 32-layer graph costs ~75 ms.
    """
    root = torch.nn.Module()
    gm_in = program.graph_module
    graph = gm_in.graph
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    state = {**program.state_dict, **program.constants}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_user_input = next(n for n in placeholders if specs[n.name].kind == InputKind.USER_INPUT)
    for node in placeholders:
        spec = specs[node.name]
        if spec.kind == InputKind.USER_INPUT:
            continue
        name = _strip_prefix(spec.target)
        value = state[spec.target]
        if isinstance(value, FakeTensor) or value.device.type == "meta":
            value = torch.empty(value.shape, dtype=value.dtype, device="meta")  # loaded later
        set_tensor_attr(root, name, value, as_parameter=spec.kind == InputKind.PARAMETER)
        with graph.inserting_before(first_user_input):
            attr = graph.create_node("get_attr", name)  # graph.get_attr would look in the old root
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr)
        graph.erase_node(node)
    for node in graph.find_nodes(op="placeholder"):
        node.target = node.name
    _single_output(graph)
    gm = _LazyGraphModule(root, graph)
    return cleanup_graph(gm)


def _strip_prefix(name: str) -> str:
    return name[len(_WRAPPER_PREFIX) :] if name.startswith(_WRAPPER_PREFIX) else name


def _single_output(graph: fx.Graph) -> None:
    output = graph.output_node()
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        (result,) = result
    output.args = (result,)


def set_tensor_attr(root: torch.nn.Module, name: str, value: torch.Tensor, as_parameter: bool) -> None:
    """Register ``value`` at dotted ``name`` under ``root``, creating empty submodules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if as_parameter:
        module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
    else:
        module.register_buffer(leaf, value)


def get_tensor_attr(root: torch.nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    module = root.get_submodule(module_name) if module_name else root
    return getattr(module, leaf)
