"""decode_linear: the plain linear layers -> ``autodeploy::linear`` (a GEMV in decode steps of one row).

After ``fuse_norm_linear`` the q/k/v, gate/up and down projections of a pre-norm decoder already run
as fused ops that take the GEMV at one row; what is left are linears that no norm or activation
precedes: the attention output projection and the LM head. ``autodeploy::linear`` is ``F.linear``
(exactly, on the CPU and for more rows) and the GEMV of ``kernels/gemv.py`` for a CUDA call of one
row, so a decode step's chain of linears is one kind of kernel, each loading its first weight tile
while the kernel before it finishes (programmatic dependent launch; cuBLAS does not take part).

Every ``aten.linear`` is replaced: the op decides per call (rows, weight size, layout, dtype) and
falls back to ``F.linear`` for anything else. Run it after every pass that matches ``aten.linear``
(the GEMM fusions, sharding, quantization).
"""

from __future__ import annotations

import torch
from torch import fx

from autodeploy.graph.rewrite import RuleResult

aten = torch.ops.aten
LINEAR = torch.ops.autodeploy.linear.default


def use_decode_linear(gm: fx.GraphModule) -> RuleResult:
    result = RuleResult()
    graph = gm.graph
    for node in list(graph.find_nodes(op="call_function", target=aten.linear.default)):
        x, weight, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        with graph.inserting_before(node):
            new = graph.call_function(LINEAR, (x, weight, bias))
        new.meta.update(node.meta)  # same value, shape and source location
        new.meta["autodeploy_provenance"] = "decode_linear"
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        result.matches += 1
    gm.recompile()
    return result
