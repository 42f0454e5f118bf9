"""Hugging Face Hub ids as model sources, resolved through a fake cache in huggingface_hub's layout
(``models--org--name/refs/<ref>`` holding a commit, ``snapshots/<commit>/`` the files); no network."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from autodeploy.errors import ModelLoadError
from autodeploy.hub import is_complete_checkpoint, looks_like_hub_id
from autodeploy.model_loading import resolve_model_path

MAIN = "a" * 40
V1 = "b" * 40


def add_snapshot(cache, repo_id: str, commit: str, source, refs=("main",), files=None):
    """``source``'s files (or only ``files`` of them) as the snapshot ``commit`` of ``repo_id``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        if files is None or f.name in files:
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # (no local directory named like the ids)
    return cache


def test_a_cached_hub_id_resolves_to_its_snapshot_without_network(hub_cache, tiny_llama):
    main = add_snapshot(hub_cache, "org/tiny", MAIN, tiny_llama)
    v1 = add_snapshot(hub_cache, "org/tiny", V1, tiny_llama, refs=("v1",))
    assert resolve_model_path("org/tiny") == main
    assert resolve_model_path("org/tiny", revision="v1") == v1
    assert resolve_model_path("org/tiny", revision=V1) == v1  # a commit: snapshots/<commit> directly


def test_compile_and_serve_settings_take_a_hub_id(hub_cache, tiny_llama):
    import autodeploy
    from autodeploy.cli import build_parser
    from autodeploy.serve.cli import serve_settings

    snapshot = add_snapshot(hub_cache, "org/tiny", MAIN, tiny_llama)
    model = autodeploy.compile("org/tiny", device="cpu", dtype="float32", max_seq_len=32, num_kv_blocks=8)
    assert model.model_dir == snapshot
    settings, options = serve_settings(build_parser().parse_args(["serve", "org/tiny", "--revision", "v2"]))
    assert settings.served_model_name == ["org/tiny"]  # clients (guidellm) load its tokenizer by that name
    assert options["revision"] == "v2"


def test_an_id_neither_cached_nor_reachable_is_a_clear_error(hub_cache, monkeypatch):
    with pytest.raises(ModelLoadError, match="not in the local cache|does not hold it") as offline:
        resolve_model_path("org/missing")
    assert "HF_HUB_OFFLINE" in str(offline.value) and "hf download org/missing" in str(offline.value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelLoadError, match="neither in the local cache .* nor reachable"):
        resolve_model_path("org/missing", revision="main")


def test_an_incomplete_cached_snapshot_is_not_taken_for_a_checkpoint(hub_cache, tiny_llama):
    add_snapshot(hub_cache, "org/partial", MAIN, tiny_llama, files={"config.json"})  # (what AutoConfig caches)
    with pytest.raises(ModelLoadError, match="holds an incomplete copy"):
        resolve_model_path("org/partial")


def test_complete_checkpoints(tmp_path, tiny_llama):
    assert is_complete_checkpoint(tiny_llama)
    (tmp_path / "config.json").write_text("{}")
    assert not is_complete_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-1.safetensors"}}')
    (tmp_path / "model-0.safetensors").write_bytes(b"")
    assert not is_complete_checkpoint(tmp_path)  # the shard the index names is missing


@pytest.mark.parametrize("name, expected", [
    ("org/name", True), ("gpt2", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("./model", False),
    ("/abs/path", False), ("a/b/c", False), ("model.gguf", False), ("~/models/x", False), ("org/na--me", False),
])
def test_what_looks_like_a_hub_id(name, expected):
    assert looks_like_hub_id(name) is expected


def test_a_local_directory_wins_over_a_hub_id(hub_cache, tiny_llama):
    local = hub_cache.parent / "org" / "tiny"
    shutil.copytree(tiny_llama, local)
    assert resolve_model_path("org/tiny") == Path("org/tiny")  # (the working directory's)
