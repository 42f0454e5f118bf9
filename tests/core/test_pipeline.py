import sys
import textwrap
from pathlib import Path

import pytest

from autodeploy.errors import ConfigError
from autodeploy.pipeline import PASSES, Pass, PassConfig, PassResult, Stage, load_pipeline
from autodeploy.pipeline.runner import DEFAULT_PIPELINE, check_order
from autodeploy.registry import Registry


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_default_pipeline_loads_and_is_ordered():
    entries = load_pipeline()
    names = [e.name for e in entries]
    assert names[0] == "canonicalize_attention" and "insert_kv_cache" in names
    stages = [e.pass_cls.stage for e in entries]
    assert stages == sorted(stages)


def test_per_pass_overrides_are_validated():
    entries = load_pipeline(overrides={"canonicalize_moe": {"enabled": False}})
    assert not next(e for e in entries if e.name == "canonicalize_moe").config.enabled
    with pytest.raises(ConfigError, match="not in the pipeline: nope"):
        load_pipeline(overrides={"nope": {}})
    with pytest.raises(ConfigError, match="config of pass 'gather_logits'.*unknown_field"):
        load_pipeline(overrides={"gather_logits": {"unknown_field": 1}})


def test_stage_going_backwards_is_rejected(tmp_path):
    path = _yaml(tmp_path, """
        - pass: insert_kv_cache
        - pass: canonicalize_attention
          rules: [match_eager_attention]
    """)
    with pytest.raises(ConfigError, match="cannot run after 'insert_kv_cache'"):
        load_pipeline(path)


def test_missing_requirement_is_rejected(tmp_path):
    path = _yaml(tmp_path, """
        - pass: gather_logits
        - pass: insert_kv_cache
    """)
    with pytest.raises(ConfigError, match="requires \\['attention_canonical'\\]"):
        load_pipeline(path)


def test_disabled_provider_breaks_dependents():
    with pytest.raises(ConfigError, match="requires \\['attention_canonical'"):
        load_pipeline(overrides={"canonicalize_attention": {"enabled": False}})


def test_unknown_pass_lists_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown pass 'no_such_pass'; known: .*gather_logits"):
        load_pipeline(_yaml(tmp_path, "- pass: no_such_pass\n"))


def test_one_new_file_plus_one_line_adds_a_pass(tmp_path, monkeypatch):
    """An out-of-tree pass: a module registering itself, named by one pipeline line."""
    (tmp_path / "my_pass.py").write_text(textwrap.dedent("""
        from autodeploy.pipeline import PASSES, Pass, PassConfig, PassResult, Stage

        class CountNodesConfig(PassConfig):
            label: str = "nodes"

        @PASSES.register("count_nodes_test")
        class CountNodes(Pass):
            name = "count_nodes_test"
            stage = Stage.FUSE
            Config = CountNodesConfig
            def apply(self, ctx):
                return PassResult(len(ctx.gm.graph.nodes), self.config.label)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    PASSES.register_lazy("count_nodes_test", "my_pass:CountNodes")
    text = DEFAULT_PIPELINE.read_text().replace("- pass: load_weights", "- pass: count_nodes_test\n- pass: load_weights")
    entries = load_pipeline(_yaml(tmp_path, text), overrides={"count_nodes_test": {"label": "x"}})
    entry = next(e for e in entries if e.name == "count_nodes_test")
    assert entry.config.label == "x" and entry.pass_cls.stage == Stage.FUSE


def test_entry_point_registration(tmp_path, monkeypatch):
    dist = tmp_path / "plugin_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[autodeploy.passes]\nplugin_pass = plugin_mod:PluginPass\n")
    (tmp_path / "plugin_mod.py").write_text(textwrap.dedent("""
        from autodeploy.pipeline import Pass, PassResult, Stage
        class PluginPass(Pass):
            name = "plugin_pass"
            stage = Stage.FUSE
            def apply(self, ctx):
                return PassResult()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: Registry = Registry("pass", entry_point_group="autodeploy.passes")
    assert "plugin_pass" in registry.names()
    assert registry.get("plugin_pass").__name__ == "PluginPass"
    sys.modules.pop("plugin_mod", None)


def test_registry_rejects_duplicates():
    registry: Registry = Registry("thing")
    registry.register("a")(1)
    with pytest.raises(KeyError, match="already registered"):
        registry.register("a")(2)


def test_check_order_on_custom_classes():
    class Early(Pass):
        name, stage, ensures = "early", Stage.CANONICALIZE, ("x",)

        def apply(self, ctx):
            return PassResult()

    class Late(Pass):
        name, stage, requires = "late", Stage.FUSE, ("x",)

        def apply(self, ctx):
            return PassResult()

    from autodeploy.pipeline import PipelineEntry

    check_order([PipelineEntry("early", Early, PassConfig()), PipelineEntry("late", Late, PassConfig())])
    with pytest.raises(ConfigError):
        check_order([PipelineEntry("late", Late, PassConfig())])


def test_cleanup_removes_noop_slices_and_arithmetic():
    import torch

    from autodeploy.testing import export_for_test

    class M(torch.nn.Module):
        def forward(self, x):
            return (x[:, :, None, :][:, :, :, 0:] * 1.0 + 0).sum(-1)

    gm = export_for_test(M(), (torch.randn(2, 3, 4),))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.slice.Tensor not in targets and torch.ops.aten.mul.Tensor not in targets
    assert torch.ops.aten.add.Tensor not in targets
