"""The shared rewrite-test helper (rule of the house 3): every rule and pass is tested with it.

``check_rewrite`` exports a tiny eager module the way the compiler exports models, applies a rule
(or any graph function, e.g. :func:`pass_runner` for a whole pass), and checks the exact match
count, that the graph is still valid, and that the rewritten graph equals eager on the example
inputs *and* on a second, differently shaped input. ``reusing_exports`` lets a test compile one
model several ways from one export.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from . import ops  # noqa: F401  (registers the canonical ops)
from .graph.cleanup import cleanup_graph
from .graph.rewrite import RewriteRule, RuleResult, apply_rule
from .pipeline import PASSES, CompileContext, PipelineEntry, run_pipeline


@dataclass
class RewriteCheck:
    gm: fx.GraphModule
    result: RuleResult

    def count(self, target) -> int:
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function" and n.target == target)


def export_for_test(module: torch.nn.Module, inputs: tuple, dynamic: dict[int, int] | None = None) -> fx.GraphModule:
    """Export ``module`` like the compiler does; ``dynamic`` maps input index -> dynamic dim.

    Dynamic dims are ``Dim.DYNAMIC``, as in the compiler's export: no range (a range makes export reject
    code that holds only for shorter steps, e.g. a buffer sliced to the token count), and one symbol
    where the module's code ties them (as HF models tie ``input_ids`` and ``position_ids``)."""
    dynamic = dynamic or {}
    tokens = torch.export.Dim.DYNAMIC
    shapes = tuple({dynamic[i]: tokens} if i in dynamic else None for i in range(len(inputs)))
    with torch.no_grad():
        program = torch.export.export(module.eval(), inputs, dynamic_shapes=shapes, strict=False)
    gm = program.module()
    return cleanup_graph(gm)


def check_rewrite(
    module: torch.nn.Module,
    inputs: tuple,
    rule: RewriteRule | Callable[[fx.GraphModule], RuleResult],
    *,
    expected_matches: int,
    second_inputs: tuple | None = None,
    dynamic: dict[int, int] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> RewriteCheck:
    gm = export_for_test(module, inputs, dynamic)
    result = apply_rule(gm, rule, provenance="test") if isinstance(rule, RewriteRule) else rule(gm)
    assert result.matches == expected_matches, (
        f"expected {expected_matches} matches, got {result.matches} (rejected: {result.reasons})"
    )
    gm.graph.lint()
    gm.recompile()
    for args in [inputs] + ([second_inputs] if second_inputs is not None else []):
        with torch.no_grad():
            want, got = module(*args), gm(*args)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return RewriteCheck(gm, result)


def pass_runner(name: str, *, artifacts: dict | None = None, **settings) -> Callable[[fx.GraphModule], RuleResult]:
    """A graph function for ``check_rewrite`` that runs the registered pass ``name`` (configured
    with ``settings``, ``artifacts`` of earlier passes in its context) the way the pipeline runner
    does, so a failing pass raises ``PassError``."""
    import importlib

    from .config import CompileConfig

    importlib.import_module("autodeploy.passes")  # registers the in-tree passes
    cls = PASSES.get(name)
    entry = PipelineEntry(name, cls, cls.Config(**settings))

    def run(gm: fx.GraphModule) -> RuleResult:
        ctx = CompileContext(gm=gm, hf_config=None, config=CompileConfig(), device=torch.device("cpu"),
                             dtype=torch.float32, artifacts=dict(artifacts or {}))
        (record,) = run_pipeline(ctx, [entry])
        return RuleResult(matches=record.matches)

    return run


@contextlib.contextmanager
def reusing_exports() -> Iterator[dict]:
    """Inside, ``autodeploy.compile`` starts from a copy of the first export of each model (same class,
    config and dtype) instead of exporting it again: for tests that compile one model with different
    options (quantization, sharding, KV-cache dtype, weights), which all act after the export. Yields
    the exports made (a test can check that one was reused). Not for tests that patch modeling code."""
    from . import compiler

    export, exported = compiler.export_model, {}

    def export_once(model):
        key = (type(model), model.config.to_json_string(), next(model.parameters()).dtype)
        if key not in exported:
            exported[key] = export(model)
        return copy.deepcopy(exported[key])

    compiler.export_model = export_once
    try:
        yield exported
    finally:
        compiler.export_model = export
