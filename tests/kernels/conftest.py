"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def word_kernel_on(monkeypatch):
    """The one-row NVFP4 word kernel (``kernels/nvfp4_gemv.py``; the default), on whatever
    ``AUTODEPLOY_NVFP4_WORD_GEMV`` says."""
    from autodeploy.kernels import quant_gemv

    monkeypatch.setattr(quant_gemv, "NVFP4_WORD_GEMV", True)
