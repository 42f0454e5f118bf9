"""Tiny random checkpoints of real HF architectures (tests, the model zoo, the quick start).

``make_tiny_checkpoint("llama", dir)`` builds the real transformers model class from
``AutoConfig.for_model`` shrunk to a few layers and a small hidden size, with random weights, and
saves it with ``save_pretrained`` (safetensors). Architecture-specific sizes live in ``TINY_OVERRIDES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}

# model_type -> config fields on top of BASE (names as the HF config class spells them)
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
}


def tiny_config(model_type: str, **overrides: Any):
    from transformers import AutoConfig

    fields = {**BASE, **TINY_OVERRIDES.get(model_type, {}), **overrides}
    return AutoConfig.for_model(model_type, **fields)


def make_tiny_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random ``model_type`` checkpoint (fp32 safetensors) to ``out_dir``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
