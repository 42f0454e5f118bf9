"""Every zoo architecture compiles with zero per-model code and matches HF eager.

For each architecture (``zoo.ZOO``): a tiny random checkpoint is built once; the compiled graph must
have every attention layer as ``paged_attention`` (with the expected sliding windows and chunks) and every MoE
layer as ``moe``; then the canary (``autodeploy.check.run_check``: fp32, staggered joins, chunked
prefill mixed with decodes, 16 greedy steps) must pass at rel err <= 1e-4 with identical tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autodeploy.check import run_check
from autodeploy.compiler import compile as compile_model
from autodeploy.errors import PassError
from autodeploy.tiny import TINY_OVERRIDES, make_tiny_checkpoint

from .zoo import ZOO, ZooModel

README = Path(__file__).with_name("README.md")
STEPS = 16
PROMPT_LENS = (5, 23, 12, 40)
MAX_SEQ_LEN = max(PROMPT_LENS) + STEPS + 1


def _param(model: ZooModel):
    marks = [pytest.mark.zoo] + ([pytest.mark.slow] if model.slow else [])
    if model.xfail:
        marks.append(pytest.mark.xfail(reason=model.xfail, strict=True))
    return pytest.param(model, id=model.name, marks=marks)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core machine the threads of
    several workers oversubscribe the cores and make each tiny GEMM ~40x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def attention_flags(model, flag: str) -> list:
    nodes = model.gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.paged_attention.default)
    return [node.kwargs.get(flag) for node in nodes]


@pytest.mark.parametrize("zoo_model", [_param(m) for m in ZOO])
def test_zoo_architecture(zoo_model: ZooModel, tmp_path):
    model_dir = make_tiny_checkpoint(zoo_model.model_type, tmp_path / zoo_model.model_type)
    settings = {"dtype": "float32", "device": "cpu", "max_seq_len": MAX_SEQ_LEN,
                "attn_implementation": zoo_model.attn_implementation}
    if zoo_model.refused:
        with pytest.raises(PassError, match=zoo_model.refused):
            compile_model(model_dir, **settings)
        return
    compiled = compile_model(model_dir, **settings)
    counts = compiled.report.op_counts
    layers = zoo_model.attention_layers or compiled.hf_config.num_hidden_layers
    assert counts.get("paged_attention") == layers, f"attention layers not all canonicalized: {counts}"
    state_ops = (counts.get("ssm_scan_cached", 0), counts.get("causal_conv1d_cached", 0))
    assert state_ops == (zoo_model.state_layers,) * 2, f"state layers not all canonicalized: {counts}"
    assert attention_flags(compiled, "sliding_window") == list(zoo_model.windows)
    assert attention_flags(compiled, "chunk_size") == list(zoo_model.chunks)
    assert [slopes is not None for slopes in attention_flags(compiled, "alibi_slopes")] == [zoo_model.alibi] * layers
    assert counts.get("moe", 0) == zoo_model.moe_layers, f"MoE layers not all canonicalized: {counts}"
    result = run_check(model_dir, steps=STEPS, prompt_lens=PROMPT_LENS, compiled=compiled)
    assert result.passed, result.summary()
    assert result.tokens_compared == STEPS * len(PROMPT_LENS)


def test_readme_lists_every_architecture_with_its_status():
    rows = dict(re.findall(r"^\| `([\w-]+)` \| (\w+) \|", README.read_text(), flags=re.M))
    assert set(rows) == {m.name for m in ZOO}
    for model in ZOO:
        assert rows[model.name] == ("xfail" if model.xfail else "refused" if model.refused else "passes"), model.name


def test_every_zoo_architecture_has_tiny_sizes():
    assert {m.model_type for m in ZOO} <= set(TINY_OVERRIDES)


@pytest.mark.zoo
@pytest.mark.parametrize("model_type", sorted(set(TINY_OVERRIDES) - {m.model_type for m in ZOO}))
def test_tiny_checkpoint_of_every_architecture_listed_outside_the_zoo(model_type, tmp_path):
    """``autodeploy tiny`` works for the architectures the README lists as checked but left out."""
    path = make_tiny_checkpoint(model_type, tmp_path)
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
