"""GGUF input: a ``.gguf`` file becomes a cached HF checkpoint directory, converted once.

The weights are dequantized by transformers' GGUF reader (``from_pretrained(..., gguf_file=...)``,
which uses the ``gguf`` package) and saved with ``save_pretrained`` as safetensors, next to the
tokenizer (with its chat template) and the generation config; after that the directory is compiled
like any other checkpoint.

Cache: ``$AUTODEPLOY_CACHE_DIR/gguf/<stem>-<key>/`` (default ``~/.cache/autodeploy``). The key hashes
the GGUF file's resolved path, size and modification time (plus ``CONVERTER_VERSION``): it costs
nothing even for a 40 GB file, where hashing the content would take a minute on every start, and a
file replaced or edited in place gets a new entry. (A copy of the file at another path converts again.)

Atomic: a conversion writes into a temporary directory next to its entry and renames it into place
at the end, under a per-entry file lock; an interrupted conversion never leaves a readable entry,
and its leftovers are removed by the next conversion of the same file.

Dtype: every tensor is saved in the narrowest of bfloat16, float16 and float32 that holds all of the
model's dequantized values exactly. Quantized GGUFs (``q = d * x + m`` with fp16 scales, computed
in fp32) need float32; an F16 or BF16 GGUF stays 16-bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .errors import ModelLoadError

log = logging.getLogger("autodeploy.gguf")

GGUF_SUFFIX = ".gguf"
CACHE_ENV = "AUTODEPLOY_CACHE_DIR"
DEFAULT_CACHE = Path("~/.cache/autodeploy")
CONVERTER_VERSION = 1  # bump when the converted layout changes: older cache entries are then ignored
SOURCE_RECORD = "autodeploy_gguf_source.json"
NARROW_DTYPES = (torch.bfloat16, torch.float16)  # tried before float32, which always holds the values
GGUF_EXTRA_HINT = 'pip install "autodeploy[gguf]"  (the gguf and accelerate packages)'


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``*.gguf`` of a directory that is
    not a checkpoint directory (no config.json). None when ``path`` is not GGUF input."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ModelLoadError(f"{path} holds {len(found)} GGUF files ({names}); pass the one to use")
    return found[0] if found else None


def cache_root() -> Path:
    """Where converted checkpoints live: ``$AUTODEPLOY_CACHE_DIR/gguf`` (default ``~/.cache/autodeploy``)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser() / "gguf"


def cache_key(gguf_path: Path) -> str:
    """Identity of a GGUF file: resolved path, size, mtime (see the module docstring for why)."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    identity = f"{CONVERTER_VERSION}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def converted_checkpoint(gguf_path: str | Path) -> Path:
    """The HF checkpoint directory of ``gguf_path``, converting it on first use (see the module docstring)."""
    from filelock import FileLock

    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    root = cache_root()
    name = f"{gguf_path.stem}-{cache_key(gguf_path)}"
    entry = root / name
    if entry.is_dir():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{name}.lock")):
        if entry.is_dir():  # another process converted it while we waited for the lock
            return entry
        _remove_leftovers(root, name)
        _convert_into(gguf_path, entry)
    return entry


def _remove_leftovers(root: Path, name: str) -> None:
    """Temporary directories of earlier conversions of this entry that were killed mid-way."""
    for stale in root.glob(f".tmp-{name}-*"):
        log.warning("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _convert_into(gguf_path: Path, entry: Path) -> None:
    """Convert into a temporary sibling of ``entry``, then rename it into place (atomic)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        start = time.perf_counter()
        record = convert_gguf(gguf_path, tmp)
        record["convert_seconds"] = round(time.perf_counter() - start, 2)
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        os.rename(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s into %s in %.1f s", gguf_path, entry, record["convert_seconds"])


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantize ``gguf_path`` into the HF checkpoint directory ``out_dir``; returns what was done."""
    _require_gguf_support()
    model = _load_model(gguf_path)
    dtype = lossless_dtype(model.state_dict().values())
    tokenizer = load_tokenizer(gguf_path, model.config)
    model.to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stat = gguf_path.stat()
    return {
        "gguf_file": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": str(dtype).removeprefix("torch."),
        "converter_version": CONVERTER_VERSION,
    }


def _require_gguf_support() -> None:
    from transformers.utils import is_accelerate_available, is_gguf_available

    available = {"gguf": is_gguf_available(), "accelerate": is_accelerate_available()}
    missing = [name for name, ok in available.items() if not ok]
    if missing:
        raise ModelLoadError(f"reading GGUF files needs {' and '.join(missing)}: {GGUF_EXTRA_HINT}")


def _load_model(gguf_path: Path) -> torch.nn.Module:
    """The model with every weight dequantized to float32 (which holds every dequantized value;
    ``lossless_dtype`` narrows it afterwards where it can)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            # dequantize=True: never keep weights in GGUF blocks (transformers does where it has a kernel)
            quantization_config=GgufConfig(dequantize=True),
        )
    except (ValueError, KeyError, RuntimeError) as exc:  # unsupported architecture or quant type; bad file
        raise ModelLoadError(f"transformers cannot read {gguf_path}: {exc}") from exc
    # the weights are plain dense tensors now: drop the GGUF quantizer, which refuses save_pretrained
    # (with dequantize=True, transformers 5.17 attaches none and leaves only the config entry)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model


def lossless_dtype(tensors) -> torch.dtype:
    """The narrowest of bfloat16, float16, float32 that holds every floating value of ``tensors`` exactly."""
    tensors = [t for t in tensors if t.is_floating_point()]
    for dtype in NARROW_DTYPES:
        if all(torch.equal(t.to(dtype).to(t.dtype), t) for t in tensors):
            return dtype
    return torch.float32


def load_tokenizer(gguf_path: Path, config):
    """The GGUF's tokenizer (chat template included), with its special tokens taken from the GGUF's
    token ids, which transformers maps onto ``config``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers' GGUF Llama tokenizer converter (5.17) names the BOS token as EOS too, so the
    # chat model would never stop; the ids in the GGUF metadata are the ground truth.
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    max_len = getattr(config, "max_position_embeddings", None)
    if isinstance(max_len, int):  # the converter leaves "unlimited" (1e30)
        tokenizer.model_max_length = max_len
    if type(tokenizer.backend_tokenizer.model).__name__ == "BPE":
        # transformers ignores clean_up_tokenization_spaces=True for BPE (and warns on every decode):
        # saying False gives the same text without the warning
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer
