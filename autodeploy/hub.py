"""Hugging Face Hub ids as model sources: ``org/name`` (optionally at a ``revision``) -> a local
snapshot directory, through ``huggingface_hub`` and its cache (``HF_HUB_CACHE`` / ``HF_HOME``).

The local cache is tried first and, when it holds a complete checkpoint (``config.json`` and its
weights), used without touching the network. Otherwise the checkpoint is downloaded, unless
``HF_HUB_OFFLINE`` is set. Only what autodeploy reads is downloaded: configs, tokenizer files and
safetensors weights (pickle weights only with ``allow_pickle``; never GGUF, ONNX or other formats).
Every failure is a :class:`ModelLoadError` that says what was tried and what to do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .errors import ModelLoadError

log = logging.getLogger("autodeploy.hub")

# formats autodeploy does not read: a repository often carries several besides safetensors
NOT_READ = ["*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.mlmodel",
            "*.mlpackage/*", "original/*", "*.nemo", "*.llamafile"]
PICKLE = ["*.bin", "*.pt", "*.pth", "*.ckpt"]


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled like a Hub repository id (``name`` or ``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or name.startswith((".", "/", "~")) or name.endswith((".gguf", "/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_hub_model(repo_id: str, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (default: ``main``): from the
    cache when complete there, else downloaded (unless offline)."""
    from huggingface_hub import constants

    cached = _cached_snapshot(repo_id, revision)
    if cached is not None and (is_complete_checkpoint(cached, allow_pickle) or _holds_gguf(cached)):
        log.info("%s: using the cached snapshot %s", repo_id, cached)
        return cached
    where = _describe(repo_id, revision)
    if constants.HF_HUB_OFFLINE:
        state = "holds an incomplete copy" if cached is not None else "does not hold it"
        raise ModelLoadError(
            f"{where} is not a local path, and as a Hugging Face Hub id it cannot be loaded: the local cache "
            f"({constants.HF_HUB_CACHE}) {state} and HF_HUB_OFFLINE is set. Download it where the network "
            f"allows (hf download {repo_id}{_revision_flag(revision)}), unset HF_HUB_OFFLINE, or pass a "
            "checkpoint directory."
        )
    path = _download(repo_id, revision, allow_pickle, where)
    if not is_complete_checkpoint(path, allow_pickle):
        raise ModelLoadError(
            f"{where} on the Hugging Face Hub has no config.json with safetensors weights that autodeploy can "
            f"read (downloaded to {path}). A GGUF repository: download the one .gguf file you want and pass its "
            "path; pickle (.bin) weights: pass --allow_pickle if you trust the source."
        )
    return path


def is_complete_checkpoint(path: Path, allow_pickle: bool = False) -> bool:
    """``config.json`` and weights: every shard a safetensors index names, or some weight file."""
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((path / shard).is_file() for shard in shards)
    patterns = ["*.safetensors"] + (PICKLE if allow_pickle else [])
    return any(f.is_file() for pattern in patterns for f in path.glob(pattern))


def _holds_gguf(path: Path) -> bool:
    """A cached GGUF repository (no config.json): the one GGUF file is the model."""
    return not (path / "config.json").exists() and any(path.glob("*.gguf"))


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:  # (an incomplete snapshot too, where the cache knows it is)
        return None


def _download(repo_id: str, revision: str | None, allow_pickle: bool, where: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    ignore = NOT_READ + ([] if allow_pickle else PICKLE)
    log.warning("downloading %s from the Hugging Face Hub into %s", where, constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, revision=revision, ignore_patterns=ignore))
    except RevisionNotFoundError:
        raise ModelLoadError(f"{where}: the Hugging Face Hub has no revision '{revision}' of {repo_id}") from None
    except GatedRepoError:
        raise ModelLoadError(f"{where} is gated on the Hugging Face Hub: accept its terms on the Hub, then set "
                             "HF_TOKEN (or run hf auth login)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{where} is not a local path, and no model of that id exists on the Hugging Face "
                             "Hub (or it is private: set HF_TOKEN)") from None
    except (LocalEntryNotFoundError, OSError) as exc:  # no connection, Hub down, disk full...
        raise ModelLoadError(
            f"{where} is not a local path, and as a Hugging Face Hub id it is neither in the local cache "
            f"({constants.HF_HUB_CACHE}) nor reachable ({type(exc).__name__}: {_first_line(exc)}). Download it "
            f"where the network allows (hf download {repo_id}{_revision_flag(revision)}), or pass a checkpoint "
            "directory."
        ) from None


def _describe(repo_id: str, revision: str | None) -> str:
    return f"'{repo_id}'" + (f" (revision {revision})" if revision else "")


def _revision_flag(revision: str | None) -> str:
    return f" --revision {revision}" if revision else ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
