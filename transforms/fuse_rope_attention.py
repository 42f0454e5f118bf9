"""fuse_rope_attention: a ``rope_qk`` feeding only the q and k of one paged attention -> that
attention's rotary inputs, so the kernel rotates q and the new keys as it loads them (one launch less).

Runs after ``insert_kv_cache`` (the attention is a paged-attention op of any backend; they share
one schema). Matched: ``paged(q', k', ...)`` where q' and k' lead back through layout ops
(transpose, permute, squeeze/unsqueeze, view/reshape/flatten/unflatten that only add or drop
size-1 dims, contiguous/clone/alias) to outputs 0 and 1 of one ``rope_qk`` whose outputs nothing else reads.
The layout chains are re-pointed at ``rope_qk``'s inputs (a view becomes a reshape: the input may
be a strided slice) and the attention gets cos/sin reshaped to [T, R], one row per token.

Rejected, counted with a reason: a chain through other ops or mixing the head dim, rotated q/k
read elsewhere, cos/sin that vary along anything but the token (e.g. per head), that broadcast
q/k up, or whose dtype would promote q/k (the unfused graph would attend in the wider dtype); with
``fp8_pools=False``, an attention over a one-byte (FP8) pool.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.rewrite import RuleResult
from autodeploy.ops.attention_backends import ATTENTION_BACKENDS

aten = torch.ops.aten
ROPE_QK = torch.ops.autodeploy.rope_qk.default
PROVENANCE = "fuse_rope_attention"
_IDENTITY = {aten.contiguous.default, aten.clone.default, aten.alias.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default}  # become reshapes: they cannot take strided inputs
_RESHAPES = {*_VIEWS, aten.reshape.default, aten.flatten.using_ints, aten.unflatten.int}
_DIM_OPS = {aten.transpose.int, aten.permute.default, aten.squeeze.dim, aten.unsqueeze.default}
_LAYOUT = _IDENTITY | _RESHAPES | _DIM_OPS


class Rejected(Exception):
    """Why one attention's rotation stays a separate ``rope_qk``."""


@dataclass(frozen=True)
class _Side:
    """The layout chain from one ``rope_qk`` output (``getitem``) to the attention's q or k."""

    getitem: fx.Node
    chain: list[fx.Node]  # from the getitem's user to the attention's argument, in graph order
    token_dim: int  # dim of the rope input that becomes the attention's token dim

    @property
    def rope(self) -> fx.Node:
        return self.getitem.args[0]


def paged_attention_ops() -> set:
    """Every registered paged-attention backend's op (they share one schema)."""
    return {ATTENTION_BACKENDS.get(name).op for name in ATTENTION_BACKENDS.names()}


def fuse_rope_attention(gm: fx.GraphModule, fp8_pools: bool = True) -> RuleResult:
    """Fold each eligible ``rope_qk`` into the paged attention it feeds; see the module docstring.
    ``fp8_pools``: also into the attentions whose KV pool holds one-byte (FP8) values."""
    result = RuleResult()
    for attention in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in paged_attention_ops()]:
        if attention.kwargs.get("rope_cos") is not None:
            continue
        try:
            sides = _match(attention)
            if sides is not None and not fp8_pools and _pool_itemsize(attention) == 1:
                raise Rejected("its KV pool is FP8 (fp8_pools=False: q and k rotated before the attention)")
        except Rejected as why:
            result.rejected += 1
            result.reasons.append(f"{attention.name}: {why}")
            continue
        if sides is not None:
            _fold(gm, attention, *sides)
            result.matches += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return result


def _match(attention: fx.Node) -> tuple[_Side, _Side] | None:
    """The q and k sides of one ``rope_qk`` feeding ``attention`` (None: no rope_qk feeds it)."""
    q_item, k_item = _rope_output(attention.args[0]), _rope_output(attention.args[1])
    if q_item is None and k_item is None:
        return None
    if q_item is None or k_item is None or q_item.args[0] is not k_item.args[0] or q_item.args[1] != 0 \
            or k_item.args[1] != 1:
        raise Rejected("q and k are not outputs 0 and 1 of one rope_qk")
    rope = q_item.args[0]
    q_side, k_side = _side(q_item, attention.args[0]), _side(k_item, attention.args[1])
    if set(rope.users) != {q_item, k_item}:
        raise Rejected(f"{rope.name} has other users")
    _check_rotation(rope, q_side, k_side)
    return q_side, k_side


def _pool_itemsize(attention: fx.Node) -> int:
    """Bytes per value of the attention's KV pool (its fourth argument, as ``insert_kv_cache`` builds it)."""
    return attention.args[3].meta["val"].dtype.itemsize


def _rope_output(node) -> fx.Node | None:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _LAYOUT:
        node = node.args[0]
    is_item = isinstance(node, fx.Node) and node.target is operator.getitem
    return node if is_item and getattr(node.args[0], "target", None) == ROPE_QK else None


def _side(getitem: fx.Node, arg: fx.Node) -> _Side:
    chain, node = [], arg
    while node is not getitem:
        chain.append(node)
        node = node.args[0]
    chain.reverse()
    for producer in [getitem, *chain[:-1]]:
        if len(producer.users) != 1:
            raise Rejected(f"{producer.name} (rotated {'q' if getitem.args[1] == 0 else 'k'}) has other users")
    if len(arg.users) != 1:
        raise Rejected(f"{arg.name} is read by more than the attention")
    labels = list(range(getitem.meta["val"].dim()))
    for node in chain:
        labels = _relabel(node, labels)
    if len(labels) != 3 or labels[0] is None or labels[2] != getitem.meta["val"].dim() - 1:
        raise Rejected(f"{arg.name}: the layout chain does not map the rotated head vectors to [T, H, D] rows")
    return _Side(getitem, chain, labels[0])



def _relabel(node: fx.Node, labels: list) -> list:
    """Which dim of the rope input each dim of ``node``'s output is (None: a size-1 dim it added)."""
    before, after = node.args[0].meta["val"].shape, node.meta["val"].shape
    if node.target in _IDENTITY:
        return labels
    if node.target == aten.transpose.int:
        a, b = (d % len(labels) for d in node.args[1:3])
        labels = list(labels)
        labels[a], labels[b] = labels[b], labels[a]
        return labels
    if node.target == aten.permute.default:
        return [labels[d % len(labels)] for d in node.args[1]]
    if node.target == aten.squeeze.dim:
        dim = node.args[1] % len(labels)
        return labels[:dim] + labels[dim + 1:] if before[dim] == 1 else labels
    if node.target == aten.unsqueeze.default:
        dim = node.args[1] % (len(labels) + 1)
        return labels[:dim] + [None] + labels[dim:]
    kept = [(size, label) for size, label in zip(before, labels) if size != 1]
    if [str(s) for s, _ in kept] != [str(s) for s in after if s != 1]:
        raise Rejected(f"{node.name} reshapes {tuple(before)} -> {tuple(after)} beyond size-1 dims")
    labels_left = iter(label for _, label in kept)
    return [None if size == 1 else next(labels_left) for size in after]


def _check_rotation(rope: fx.Node, q_side: _Side, k_side: _Side) -> None:
    """cos/sin must give one rotation per token that q and k take as they are (no broadcast, no promotion)."""
    x_q, x_k, cos, sin = rope.args[:4]
    cos_shape = cos.meta["val"].shape
    if tuple(sin.meta["val"].shape) != tuple(cos_shape):
        raise Rejected("cos and sin differ in shape")
    token_dims = set()
    for side, x in ((q_side, x_q), (k_side, x_k)):
        x_val, out_val = x.meta["val"], side.getitem.meta["val"]
        if tuple(out_val.shape) != tuple(x_val.shape) or out_val.dtype != x_val.dtype:
            raise Rejected(f"the rotation turns {x.name} {tuple(x_val.shape)} {x_val.dtype} into "
                           f"{tuple(out_val.shape)} {out_val.dtype}")
        offset = x_val.dim() - len(cos_shape)
        if offset < 0:
            raise Rejected(f"cos {tuple(cos_shape)} has more dims than {x.name}")
        for dim, size in enumerate(cos_shape[:-1]):
            if dim + offset != side.token_dim and size != 1:
                raise Rejected(f"cos {tuple(cos_shape)} varies along dim {dim + offset} of {x.name}, "
                               "not only per token")
        if side.token_dim < offset or str(cos_shape[side.token_dim - offset]) != str(x_val.shape[side.token_dim]):
            raise Rejected(f"cos {tuple(cos_shape)} does not give each token of {x.name} its own row")
        token_dims.add(side.token_dim - offset)
    if len(token_dims) != 1:
        raise Rejected("q and k take their tokens from different dims of cos")


def _fold(gm: fx.GraphModule, attention: fx.Node, q_side: _Side, k_side: _Side) -> None:
    graph, rope = gm.graph, q_side.rope
    x_q, x_k, cos, sin, *rest = rope.args
    interleaved = bool(rest[0] if rest else rope.kwargs.get("interleaved", False))
    changed = []
    for side, x in ((q_side, x_q), (k_side, x_k)):
        consumer = side.chain[0] if side.chain else attention
        consumer.replace_input_with(side.getitem, x)
        for node in side.chain:
            if node.target in _VIEWS:
                node.target = aten.reshape.default  # x may be a strided slice a view cannot take
        changed += side.chain
    with graph.inserting_before(attention):
        per_token = [graph.call_function(aten.reshape.default, (t, [-1, t.meta["val"].shape[-1]]))
                     for t in (cos, sin)]
    attention.update_kwarg("rope_cos", per_token[0])
    attention.update_kwarg("rope_sin", per_token[1])
    attention.update_kwarg("rope_interleaved", interleaved)
    propagate_meta(gm, [*changed, *per_token, attention])
    for node in per_token:
        node.meta["autodeploy_provenance"] = PROVENANCE
    for node in (q_side.getitem, k_side.getitem, rope):
        graph.erase_node(node)
