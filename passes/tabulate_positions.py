"""tabulate_positions (stage ``cache_init``): what the graph computes from the token positions alone
becomes a table over every position the KV pool can address, evaluated once here, and a row gather
per step.

RoPE's cos/sin are the case in point: ``inv_freq @ position``, a concat, cos, sin, the attention
scaling and two casts are about eight small kernels at the start of every decode step; the table makes
them two gathers (H200, engine batch 1: SmolLM2 0.587 -> 0.566 ms; the 8B step, level).

Found by data flow, not by pattern, so any spelling of any architecture qualifies: a node is
*position-only* when its inputs are the ``position_ids`` graph input, constants (``get_attr``
tensors and what is computed from them alone) or other position-only nodes. Where the rest of the
graph reads such a value (moving up through views, which cost nothing), it is tabulated if

- it is floating point and computed by more than lookups, casts and views (an embedding of learned
  positions is a gather already);
- exactly one of its dimensions follows the number of tokens (evaluated at two lengths);
- on a random sample of positions it equals the table's rows at those positions bit for bit: a value
  that is not computed row by row (say, a dynamic RoPE that looks at the longest position) fails
  here and stays as it is, with its reason in the pass's detail.

The table is evaluated on the compile device with the graph's own ops, so its rows are exactly what
the unfolded graph computes there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autodeploy.export import set_tensor_attr
from autodeploy.graph.cleanup import eliminate_dead_code
from autodeploy.graph.meta import fake_mode_of, propagate_meta
from autodeploy.kvcache.allocator import blocks_needed
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage

aten = torch.ops.aten
POSITIONS = "position_ids"
# ops that only re-index their first input: a value read through them is tabulated before them
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.expand.default, aten.slice.Tensor, aten.select.int,
          aten.permute.default, aten.transpose.int, aten.t.default, aten.alias.default,
          aten.contiguous.default, aten.flatten.using_ints, aten.unflatten.int}
# ops that make a value a lookup at most: a root computed with nothing else is already one gather
_LOOKUP = {*_VIEWS, aten.embedding.default, aten.index_select.default, aten.to.dtype, aten.to.dtype_layout,
           aten.to.device, aten._to_copy.default}
_PROBE_LENGTHS = (37, 41)  # token counts of the two evaluations that find the token dimension


class TabulatePositionsConfig(PassConfig):
    max_table_mb: int = 512  # larger tables (very long max_seq_len) stay computed per step


@dataclass(frozen=True)
class Tabulated:
    node: fx.Node
    table: torch.Tensor
    token_dim: int


class TabulatePositions(Pass):
    name = "tabulate_positions"
    stage = Stage.CACHE_INIT
    requires = ("weights_loaded",)
    ensures = ("positions_tabulated",)
    Config = TabulatePositionsConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        positions = next((n for n in ctx.gm.graph.find_nodes(op="placeholder") if n.name == POSITIONS), None)
        if positions is None:
            return PassResult(0, f"no '{POSITIONS}' input")
        block = ctx.config.tokens_per_block
        rows = blocks_needed(ctx.artifacts["max_seq_len"], block) * block
        roots, reasons = position_reads(ctx.gm, positions)
        done = []
        for root in roots:
            found = tabulate(ctx.gm, positions, root, rows, ctx.device, self.config.max_table_mb << 20)
            if isinstance(found, str):
                reasons.append(f"{root.name}: {found}")
            else:
                done.append(found)
        for index, item in enumerate(done):
            _replace_with_gather(ctx.gm, positions, item, index)
        if done:
            eliminate_dead_code(ctx.gm)
        mb = sum(t.table.numel() * t.table.element_size() for t in done) / 2**20
        why = f"; kept: {'; '.join(reasons[:3])}" if reasons else ""
        return PassResult(len(done), f"{len(done)} position tables of {rows} rows ({mb:.1f} MB){why}")


def position_reads(gm: fx.GraphModule, positions: fx.Node) -> tuple[list[fx.Node], list[str]]:
    """The position-only values the rest of the graph reads (views walked up to what they view),
    worth a table; and why the others are not."""
    constant, derived = set(), {positions}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
        elif node.op == "call_function" and not node.is_impure():
            inputs = node.all_input_nodes
            if all(i in constant for i in inputs):
                constant.add(node)
            elif all(i in constant or i in derived for i in inputs):
                derived.add(node)
    roots, reasons = [], []
    for node in derived - {positions}:
        if all(user in derived for user in node.users):
            continue
        root = node
        while root.target in _VIEWS and root.args[0] in derived and root.args[0] is not positions:
            root = root.args[0]
        if root in roots:
            continue
        val = root.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        computed = [n for n in _ancestry(root, constant | derived) if n.op == "call_function" and n.target not in _LOOKUP]
        if not computed:
            reasons.append(f"{root.name}: a lookup already")
            continue
        roots.append(root)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(roots, key=order.__getitem__), reasons


def tabulate(gm: fx.GraphModule, positions: fx.Node, root: fx.Node, rows: int, device: torch.device,
             max_bytes: int) -> Tabulated | str:
    """``root`` evaluated at positions 0..rows-1, checked on a random sample; or why not."""
    evaluate = _evaluator(gm, positions, root)
    with torch.inference_mode():
        probes = [evaluate(torch.arange(n, device=device)) for n in _PROBE_LENGTHS]
        dims = [d for d in range(probes[0].dim()) if probes[0].shape[d] != probes[1].shape[d]]
        if probes[0].dim() != probes[1].dim() or len(dims) != 1 or probes[0].shape[dims[0]] != _PROBE_LENGTHS[0]:
            return "does not follow the tokens along one dimension"
        token_dim = dims[0]
        size = probes[0].numel() // _PROBE_LENGTHS[0] * rows * probes[0].element_size()
        if size > max_bytes:
            return f"table of {size >> 20} MB over max_table_mb"
        table = evaluate(torch.arange(rows, device=device)).contiguous()
        for sample in _samples(rows):
            sample = sample.to(device)
            if not torch.equal(evaluate(sample), table.index_select(token_dim, sample)):
                return "not computed row by row from the positions"
    return Tabulated(root, table, token_dim)


def _samples(rows: int) -> list[torch.Tensor]:
    """Positions to check a table on: both ends among random ones, then only low ones (a value that
    depends on the step's largest position differs from the table there)."""
    generator = torch.Generator().manual_seed(0)
    ends = torch.cat([torch.tensor([0, rows - 1]), torch.randint(0, rows, (35,), generator=generator)])
    return [ends, torch.randint(0, max(rows // 3, 1), (37,), generator=generator)]


def _ancestry(node: fx.Node, within: set[fx.Node]) -> list[fx.Node]:
    seen, stack = {}, [node]
    while stack:
        current = stack.pop()
        if current in seen or current not in within:
            continue
        seen[current] = None
        stack.extend(current.all_input_nodes)
    return list(seen)


def _evaluator(gm: fx.GraphModule, positions: fx.Node, root: fx.Node) -> fx.GraphModule:
    """A module computing ``root`` from the positions, with the graph's own nodes (and constants)."""
    needed = set(_ancestry(root, set(gm.graph.nodes)))
    graph = fx.Graph()
    env = {positions: graph.placeholder(POSITIONS)}
    for node in gm.graph.nodes:
        if node in needed and node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[root])
    return fx.GraphModule(gm, graph)


def _replace_with_gather(gm: fx.GraphModule, positions: fx.Node, item: Tabulated, index: int) -> None:
    name = f"position_table_{index}"
    while hasattr(gm, name):
        name += "_"
    set_tensor_attr(gm, name, item.table, as_parameter=False)
    graph = gm.graph
    with graph.inserting_before(item.node):
        table = graph.get_attr(name)
        gather = graph.call_function(aten.index_select.default, (table, item.token_dim, positions))
    with fake_mode_of(gm):  # a fake on the device the graph's other fakes live on (export's, not the table's)
        table.meta["val"] = torch.empty(item.table.shape, dtype=item.table.dtype, device=positions.meta["val"].device)
    propagate_meta(gm, [gather])
    gather.meta["autodeploy_provenance"] = "tabulate_positions"
    item.node.replace_all_uses_with(gather)
