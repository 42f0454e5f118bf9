"""Triton kernels: pure functions on tensors, called only from the canonical ops in ``autodeploy.ops``.

Importing this package needs ``triton``; the ops import it lazily, on first use on a device that
runs Triton (CUDA, or the CPU under ``TRITON_INTERPRET=1``, which the tests use).
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from ._interpreter import patch_scalar_index

    patch_scalar_index()
