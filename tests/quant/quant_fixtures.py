"""Helpers of the quantization tests: the committed producer fixtures (see
``tests/fixtures/quant/README.md``)."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def block_fp8_checkpoint(tmp_path: Path, model_type: str = "qwen3") -> Path:
    """``quant_method: fp8`` (DeepSeek-V3 / Qwen3-FP8 layout) in 16x16 blocks, written from its spec:
    transformers' own writer of it quantizes on a GPU only."""
    from safetensors.torch import load_file, save_file

    from autodeploy.quantization.numerics import quantize_fp8_blocks
    from autodeploy.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(model_type, tmp_path / model_type)
    state = load_file(path / "model.safetensors")
    for name in [n for n in state if n.endswith("proj.weight")]:
        state[name], state[name.replace(".weight", ".weight_scale_inv")] = quantize_fp8_blocks(state[name], (16, 16))
    save_file(state, path / "model.safetensors")
    edit_json(path / "config.json", lambda c: c.update(quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 16]}))
    return path
