"""GGUF input on a tiny random Llama GGUF: conversion, dtype, cache identity, atomicity, path resolution.

(The real SmolLM2 GGUF is covered in test_demo.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_gguf import make_tiny_gguf

from autodeploy import gguf_convert
from autodeploy.cli import main as cli_main
from autodeploy.errors import ModelLoadError
from autodeploy.gguf_convert import SOURCE_RECORD, converted_checkpoint, lossless_dtype
from autodeploy.model_loading import resolve_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# transforms/ on main has no match_moe rule yet; these models have no MoE


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("AUTODEPLOY_CACHE_DIR", str(root))
    return root / "gguf"


@pytest.fixture
def tiny_q8(tmp_path) -> Path:
    return make_tiny_gguf(tmp_path / "tiny-q8.gguf", "Q8_0")


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir()) if cache.exists() else []


def test_conversion_writes_a_complete_checkpoint(cache, tiny_q8):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = converted_checkpoint(tiny_q8)
    assert out.parent == cache and out.name.startswith("tiny-q8-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", SOURCE_RECORD} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32  # Q8_0 values (fp16 scale x int8) do not fit 16 bits
    assert model.config.tie_word_embeddings and getattr(model.config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(out)
    # the GGUF's own ids: bos 1, eos 2, pad 2, unk 0 (transformers' converter alone gets eos wrong)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>",
    )
    chat = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_16_bit_gguf_stays_16_bit(cache, tmp_path):
    from transformers import AutoModelForCausalLM

    out = converted_checkpoint(make_tiny_gguf(tmp_path / "tiny-f16.gguf", "F16"))
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float16


def test_lossless_dtype_picks_the_narrowest_exact_type():
    bf16_exact = torch.tensor([1.0, 0.5, 3.0])
    fp16_only = torch.tensor([1.0 + 2**-10])  # 10 mantissa bits: fp16 yes, bf16 (7 bits) no
    neither = torch.tensor([1.0 + 2**-20])
    assert lossless_dtype([bf16_exact]) == torch.bfloat16
    assert lossless_dtype([bf16_exact, fp16_only]) == torch.float16
    assert lossless_dtype([fp16_only, neither]) == torch.float32
    assert lossless_dtype([torch.tensor([3, 70000])]) == torch.bfloat16  # integer tensors are not weights


def test_cache_is_reused_and_keyed_by_file_identity(cache, tiny_q8, monkeypatch):
    first = converted_checkpoint(tiny_q8)
    calls = []
    real = gguf_convert.convert_gguf
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda *a: calls.append(a) or real(*a))
    assert converted_checkpoint(tiny_q8) == first and not calls  # converted once
    stat = tiny_q8.stat()
    os.utime(tiny_q8, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed
    second = converted_checkpoint(tiny_q8)
    assert second != first and len(calls) == 1
    assert entries(cache) == sorted([first.name, second.name])


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_no_cache_entry(cache, tiny_q8, monkeypatch, failure):
    """A failure after the weights are written, before the tokenizer: nothing readable is left."""
    written = []

    class FailingTokenizer:
        def save_pretrained(self, out_dir):
            written.extend(p.name for p in Path(out_dir).iterdir())
            raise failure

    monkeypatch.setattr(gguf_convert, "load_tokenizer", lambda *a: FailingTokenizer())
    with pytest.raises(type(failure)):
        converted_checkpoint(tiny_q8)
    assert "model.safetensors" in written  # the failure really came mid-conversion
    assert entries(cache) == []  # no entry, and no temporary directory either
    monkeypatch.undo()
    monkeypatch.setenv("AUTODEPLOY_CACHE_DIR", str(cache.parent))
    assert (converted_checkpoint(tiny_q8) / "tokenizer.json").is_file()


def test_leftovers_of_a_killed_conversion_are_removed(cache, tiny_q8):
    """A process killed mid-conversion (no chance to clean up) leaves only a temporary directory."""
    name = f"{tiny_q8.stem}-{gguf_convert.cache_key(tiny_q8)}"
    leftover = cache / f".tmp-{name}-killed"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half written")
    out = converted_checkpoint(tiny_q8)
    assert out.name == name and not leftover.exists()


def test_resolve_model_path(cache, tmp_path, tiny_q8):
    converted = resolve_model_path(tiny_q8)
    assert resolve_model_path(tmp_path) == converted  # a directory holding exactly one GGUF
    assert resolve_model_path(converted) == converted  # a checkpoint directory, as it is
    make_tiny_gguf(tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match="2 GGUF files"):
        resolve_model_path(tmp_path)


def test_missing_gguf_support_says_what_to_install(cache, tiny_q8, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_gguf_available", lambda *a: False)
    expected = r'reading GGUF files needs gguf: pip install "autodeploy\[gguf\]"'
    with pytest.raises(ModelLoadError, match=expected):
        converted_checkpoint(tiny_q8)


def test_cli_check_accepts_a_gguf_file(cache, tiny_q8, capsys):
    """compile + the HF-eager canary on the converted weights, through the CLI, from the .gguf path."""
    args = ["check", str(tiny_q8), "--device", "cpu", "--steps", "4", "--prompt_lens", "5,9"]
    code = cli_main(args)
    assert code == 0, capsys.readouterr()
    assert "PASS" in capsys.readouterr().out


def test_llm_accepts_a_gguf_file(cache, tiny_q8):
    """LLM compiles from the .gguf path and takes the tokenizer from the converted checkpoint."""
    from autodeploy import LLM, SamplingParams

    llm = LLM(str(tiny_q8), dtype="float32", device="cpu", max_seq_len=64)
    assert llm.model.model_dir == converted_checkpoint(tiny_q8)
    assert llm.tokenizer.eos_token_id == 2
    out = llm.generate("the theory", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and isinstance(out.text, str)
