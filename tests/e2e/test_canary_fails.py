"""The correctness canary can fail: a deliberately broken pass makes ``autodeploy check`` exit 1."""

import pytest
import torch
import yaml

from autodeploy.cli import main
from autodeploy.graph.meta import propagate_meta
from autodeploy.pipeline import PASSES, Pass, PassResult, Stage
from autodeploy.pipeline.runner import DEFAULT_PIPELINE
from autodeploy.tiny import make_tiny_checkpoint

aten = torch.ops.aten


class FlipRoPESign(Pass):
    """Broken on purpose: rotates every canonical rope the other way (negates sin)."""

    name = "test_flip_rope_sign"
    stage = Stage.CANONICALIZE
    requires = ("rope_canonical",)

    def apply(self, ctx) -> PassResult:
        ropes = list(ctx.gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.rope.default))
        for node in ropes:
            with ctx.gm.graph.inserting_before(node):
                negated = ctx.gm.graph.call_function(aten.neg.default, (node.args[2],))
            propagate_meta(ctx.gm, [negated])
            node.update_arg(2, negated)
        ctx.gm.recompile()
        return PassResult(len(ropes))


class PerturbWeight(Pass):
    """Broken on purpose: scales one loaded weight of the first layer by 1%."""

    name = "test_perturb_weight"
    stage = Stage.LOAD_WEIGHTS
    requires = ("weights_loaded",)

    def apply(self, ctx) -> PassResult:
        name, weight = next((n, p) for n, p in ctx.gm.named_parameters() if "layers.0." in n and p.dim() == 2)
        weight.data.mul_(1.01)
        return PassResult(1, name)


class DoNothing(Pass):
    """The control: a registered pass that leaves the model alone."""

    name = "test_do_nothing"
    stage = Stage.CANONICALIZE

    def apply(self, ctx) -> PassResult:
        return PassResult(0)


for _cls in (FlipRoPESign, PerturbWeight, DoNothing):
    if _cls.name not in PASSES:
        PASSES.register(_cls.name)(_cls)


def pipeline_with(extra_pass: str, after: str, directory) -> str:
    """The default pipeline with ``extra_pass`` inserted right after ``after``."""
    entries = yaml.safe_load(DEFAULT_PIPELINE.read_text())
    position = next(i for i, e in enumerate(entries) if e["pass"] == after) + 1
    entries.insert(position, {"pass": extra_pass})
    path = directory / f"{extra_pass}.yaml"
    path.write_text(yaml.safe_dump(entries))
    return str(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    "extra_pass, after, exit_code",
    [
        ("test_do_nothing", "canonicalize_rope", 0),
        ("test_flip_rope_sign", "canonicalize_rope", 1),
        ("test_perturb_weight", "load_weights", 1),
    ],
)
def test_check_exit_code_follows_the_pipeline(llama_dir, tmp_path, capsys, extra_pass, after, exit_code):
    pipeline = pipeline_with(extra_pass, after, tmp_path)
    code = main(["check", str(llama_dir), "--pipeline", pipeline, "--steps", "4", "--dtype", "float32",
                 "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == exit_code, out
    verdict = "PASS" if exit_code == 0 else "FAIL"
    assert out.startswith(f"{verdict}: ") and "max rel err" in out and "greedy token agreement" in out
