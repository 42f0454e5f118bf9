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
