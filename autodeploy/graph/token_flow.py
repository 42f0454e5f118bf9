"""Which nodes move information between tokens: the proof that canonical attention is the only way
a token's output depends on other tokens.

In the flattened layout every token of a step is a row of one dimension T, whatever sequence it
belongs to, and a decode step holds one token per sequence. So a graph computes the right thing
only if every op keeps the rows apart (token-local), except the canonical attention, whose history
the paged KV cache keeps, and the state ops (``ops/state_ops.py``: SSM scan, gated delta rule, lightning attention,
causal convolution), whose history the state pool keeps. Anything else that mixes rows (a scan or a convolution over tokens, a
recurrent state, padding the tokens into chunks, a sum over them, the row index used as a value) is
state the cache does not hold: decoding would silently drop it.

The proof works on the fake-tensor shapes: a dimension is a token dimension when its size involves
the symbol of the graph inputs' dynamic size. :func:`token_mixing` returns, for the first nodes
that cannot be shown token-local, why. An op is token-local when it is known to be (pointwise ops,
layout ops that keep each token dimension whole and in place, contractions/reductions/scans/indexing
along other dimensions, the token-local canonical ops); an op it does not know is reported too, so
a new spelling is refused rather than trusted.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

import sympy
import torch
from torch import fx

from .matcher import schema_values

aten = torch.ops.aten
ad = torch.ops.autodeploy

SEQUENCE_OPS = frozenset({  # history kept by the KV cache (attention; MLA: its latent) or the state pool (state ops)
    ad.attention.default, ad.mla.default,
    ad.causal_conv1d.default, ad.ssm_scan.default, ad.gated_delta_rule.default,
    ad.causal_conv1d_cached.default, ad.ssm_scan_cached.default, ad.gated_delta_rule_cached.default,
    ad.lightning_attention.default, ad.lightning_attention_cached.default,
})
TOKEN_LOCAL_CANONICAL_OPS = frozenset({
    ad.repeat_kv.default, ad.rope.default, ad.rms_norm.default, ad.swiglu.default, ad.moe.default,
})
_ELEMENTWISE = frozenset({
    aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other, aten._to_copy.default,
    aten.type_as.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh_copy.default, aten.copy_.default, aten.copy.default, aten.dropout.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.polar.default,  # complex from magnitude and angle (Llama-4's rotary embedding), element by element
})
_LAYOUT = frozenset({  # move or copy whole dimensions; the shape checks keep the token dimension whole
    aten.transpose.int, aten.permute.default, aten.t.default, aten.numpy_T.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.expand_as.default,
    aten.broadcast_to.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.unbind.int, aten.cat.default, aten.concat.default, aten.stack.default,
    aten.repeat.default, aten.repeat_interleave.self_int, aten.narrow.default, aten.unflatten.int,
    aten.constant_pad_nd.default, aten.pad.default, operator.getitem,
    aten.view_as_complex.default, aten.view_as_real.default,  # the last dimension (2 floats <-> 1 complex)
})
_FACTORIES = frozenset({  # a tensor input, if any, only lends its dtype and device
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.full.default, aten.scalar_tensor.default,
})
_RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints})
_CONTRACTIONS = frozenset({aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
                           aten.addmm.default, aten.baddbmm.default, aten.einsum.default})
_SHAPE_ONLY = frozenset({aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int})


def _dim_args(*names: str) -> Callable[[dict, int], list[int] | None]:
    """The dims an op works along, from its arguments (None or [] = every dim)."""

    def dims(args: dict, rank: int) -> list[int] | None:
        for name in names:
            if name in args:
                value = args[name]
                return None if value is None or value == [] else list(value) if isinstance(value, (list, tuple)) else [value]
        return None

    return dims


def _last_dims(args: dict, rank: int) -> list[int]:
    return list(range(rank - len(args["normalized_shape"]), rank))


def _last_two(args: dict, rank: int) -> list[int]:
    return [rank - 2, rank - 1]


_ALONG_DIMS: dict[Any, Callable[[dict, int], list[int] | None]] = {
    **dict.fromkeys([aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.prod.dim_int,
                     aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.any.dim, aten.all.dim,
                     aten.logsumexp.default, aten.var.correction, aten.std.correction, aten.var_mean.correction,
                     aten.count_nonzero.dim_IntList, aten.nansum.default, aten.linalg_vector_norm.default,
                     aten.norm.ScalarOpt_dim, aten.sum.default, aten.mean.default, aten.max.default,
                     aten.min.default], _dim_args("dim")),
    **dict.fromkeys([aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
                     aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
                     aten.logcumsumexp.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
                     aten.argsort.stable, aten.topk.default, aten.kthvalue.default, aten.median.dim, aten.diff.default,
                     aten.index_select.default, aten.gather.default, aten.scatter.src, aten.scatter.value,
                     aten.scatter_.src, aten.scatter_.value, aten.scatter_add.default, aten.scatter_reduce.two,
                     aten.index_add.default, aten.index_copy.default], _dim_args("dim")),
    **dict.fromkeys([aten.flip.default, aten.roll.default], _dim_args("dims")),
    **dict.fromkeys([aten.layer_norm.default, aten.native_layer_norm.default], _last_dims),
    **dict.fromkeys([aten.tril.default, aten.triu.default], _last_two),  # masks by row index
}


def token_symbols(gm: fx.GraphModule) -> set[sympy.Symbol]:
    """The symbols of the graph inputs' dynamic sizes (the token count T)."""
    symbols: set[sympy.Symbol] = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            symbols |= {s for size in val.shape for s in _free_symbols(size)}
    return symbols


def token_mixing(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """``(node, why)`` for every live node that cannot be shown to keep tokens apart, in graph order."""
    symbols = token_symbols(gm)
    if not symbols:
        return []
    live = _live_nodes(gm)
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node in live:
            why = _mixing(node, symbols)
            if why:
                found.append((node, why))
    return found


def _mixing(node: fx.Node, symbols: set) -> str | None:
    if "val" not in node.meta:
        return f"has no shape metadata to prove it token-local ({_name(node.target)})"
    ins, outs = _tensors(list(node.args) + list(node.kwargs.values())), _tensors([node.meta.get("val")])
    in_dims = [_token_dims(t, symbols) for t in ins]
    out_dims = [_token_dims(t, symbols) for t in outs]
    if node.target in _SHAPE_ONLY or not ins and not outs:  # size arithmetic
        return None
    if not any(in_dims + out_dims) and not _symbolic_values(node, symbols):
        return None
    if node.target in SEQUENCE_OPS:
        return None
    why = _op_mixing(node, ins, in_dims, symbols)
    for t in outs:
        why = why or _unclean_shape(t, symbols)
    if not why and any(in_dims) and outs and not any(out_dims) and node.target not in _FACTORIES:
        why = "reduces the token dimension away"
    return why


def _op_mixing(node: fx.Node, ins: list, in_dims: list[list[int]], symbols: set) -> str | None:
    target = node.target
    if target in TOKEN_LOCAL_CANONICAL_OPS or target in _ELEMENTWISE:
        return None
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return "uses the number of tokens in the step as a value" if _symbolic_values(node, symbols) else None
    if target in _FACTORIES:
        return "uses the number of tokens in the step as a value" if _symbolic_fill(node, symbols) else None
    if target in _LAYOUT:
        return _layout_mixing(node, in_dims, symbols)
    if target in _RESHAPES:
        return _reshape_mixing(ins[0], node.meta["val"], symbols)
    if target in _ALONG_DIMS:
        rank = ins[0].dim()
        dims = _ALONG_DIMS[target](dict(schema_values(node)), rank)
        along = range(rank) if dims is None else [d % max(rank, 1) for d in dims]
        return f"works along the token dimension ({_name(target)})" if set(along) & set(in_dims[0]) else None
    if target in _CONTRACTIONS:
        return _contraction_mixing(node, ins, symbols)
    if target in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten.embedding.default):
        return _indexing_mixing(node, ins, in_dims)
    if target in (aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten._convolution.default):
        return "convolves over the token dimension" if any(d >= 2 for d in in_dims[0]) else None
    if target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return "uses a token's row in the step as a value (arange over the tokens)"
    return f"is an op whose effect on tokens is not known ({_name(target)})"


_INDEX_ARGS = {aten.select.int: ("index",), aten.slice.Tensor: ("start", "end"), aten.narrow.default: ("start",)}


def _layout_mixing(node: fx.Node, in_dims: list[list[int]], symbols: set) -> str | None:
    """Selecting along another dimension at a place that moves with the token count reads by T."""
    names = _INDEX_ARGS.get(node.target)
    if not names:
        return None
    args = dict(schema_values(node))
    if args["dim"] % max(node.args[0].meta["val"].dim(), 1) in in_dims[0]:
        return None  # along the token dimension the output shape tells
    values = [args[name].meta.get("val") if isinstance(args[name], fx.Node) else args[name] for name in names]
    return "uses the number of tokens in the step as a value" if any(_free_symbols(v) & symbols for v in values) else None


def _symbolic_fill(node: fx.Node, symbols: set) -> bool:
    args = dict(schema_values(node))
    fill = args.get("fill_value", args.get("s"))
    if isinstance(fill, fx.Node):
        fill = fill.meta.get("val")
    return bool(_free_symbols(fill) & symbols)


def _reshape_mixing(src: torch.Tensor, out: torch.Tensor, symbols: set) -> str | None:
    """A reshape keeps tokens whole iff the elements before the token dimension are as many on both sides."""
    before, after = _token_dims(src, symbols), _token_dims(out, symbols)
    if not before and not after:
        return None
    if (len(before) != 1 or len(after) != 1
            or sympy.expand(_numel(src.shape[: before[0]]) - _numel(out.shape[: after[0]])) != 0):
        return f"reshapes {_shape(src, symbols)} to {_shape(out, symbols)} across the token dimension"
    return None


def _contraction_mixing(node: fx.Node, ins: list, symbols: set) -> str | None:
    """Contractions over a token dimension (``attention @ values``) mix tokens."""
    target = node.target
    if target == aten.einsum.default:
        equation = node.args[0].replace(" ", "")
        if "->" not in equation or "." in equation:
            return "is an einsum this check does not read (implicit output or '...')"
        inputs, output = equation.split("->")
        for letters, t in zip(inputs.split(","), ins):
            for letter, dim in zip(letters, range(t.dim())):
                if letter not in output and dim in _token_dims(t, symbols):
                    return "contracts over the token dimension (einsum)"
        return None
    first, second = (ins[-2], ins[-1]) if target in (aten.addmm.default, aten.baddbmm.default) else (ins[0], ins[1])
    contracted_first = first.dim() - 1 in _token_dims(first, symbols)
    contracted_second = target != aten.linear.default and max(second.dim() - 2, 0) in _token_dims(second, symbols)
    return f"contracts over the token dimension ({_name(target)})" if contracted_first or contracted_second else None


def _indexing_mixing(node: fx.Node, ins: list, in_dims: list[list[int]]) -> str | None:
    """Indexing rows of a tensor along its token dimension reads (or writes) other tokens' rows."""
    if node.target == aten.embedding.default:
        return "indexes rows along the token dimension" if 0 in in_dims[0] else None
    indices = node.args[1]
    indexed = [d for d, index in enumerate(indices) if index is not None]
    return "indexes rows along the token dimension" if set(indexed) & set(in_dims[0]) else None


def _unclean_shape(t: torch.Tensor, symbols: set) -> str | None:
    """At most one token dimension, of exactly T: padding, chunking or pairing tokens changes that."""
    token_sizes = [size for size in t.shape if _free_symbols(size) & symbols]
    if len(token_sizes) > 1:
        return f"builds a tensor over pairs of tokens {_shape(t, symbols)}"
    if token_sizes and _expr(token_sizes[0]) not in symbols:
        return f"pads or splits the token dimension into {_shape(t, symbols)}"
    return None


def _symbolic_values(node: fx.Node, symbols: set) -> bool:
    """A scalar argument (not a tensor) whose value involves the token count."""
    scalars = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, (torch.SymInt, torch.SymFloat))]
    scalars += [a.meta.get("val") for a in node.all_input_nodes if not isinstance(a.meta.get("val"), torch.Tensor)]
    return any(_free_symbols(s) & symbols for s in scalars if s is not None)


def _live_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes the output depends on, and those with side effects (in-place writes) and their inputs."""
    frontier = [n for n in gm.graph.nodes if n.op == "output" or (n.op == "call_function" and n.is_impure())]
    live: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node not in live:
            live.add(node)
            frontier.extend(node.all_input_nodes)
    return live


def _tensors(values: list) -> list[torch.Tensor]:
    out = []
    for value in values:
        if isinstance(value, fx.Node):
            value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(_tensors(list(value)))
    return out


def _token_dims(t: torch.Tensor, symbols: set) -> list[int]:
    return [d for d, size in enumerate(t.shape) if _free_symbols(size) & symbols]


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, (torch.SymInt, torch.SymFloat)) else sympy.Integer(size)


def _free_symbols(size) -> set:
    return set(_expr(size).free_symbols) if isinstance(size, (torch.SymInt, torch.SymFloat)) else set()


def _numel(sizes) -> sympy.Expr:
    return sympy.Mul(*[_expr(s) for s in sizes]) if sizes else sympy.Integer(1)


def _shape(t: torch.Tensor, symbols: set) -> str:
    """The shape with the token count written T."""
    token = {s: sympy.Symbol("T") for s in symbols}
    return "(" + ", ".join(str(_expr(size).subs(token)) for size in t.shape) + ")"


def _name(target) -> str:
    return re.sub(r"\.default$", "", str(target))
