"""Fixtures of the quantization tests."""

from __future__ import annotations

import shutil

import pytest
from quant_fixtures import FIXTURES


@pytest.fixture
def fixture_copy(tmp_path):
    """``fixture_copy(name)`` -> a writable copy of a committed fixture, to break on purpose."""

    def copy(name: str):
        out = tmp_path / name
        shutil.copytree(FIXTURES / name, out)
        return out

    return copy
