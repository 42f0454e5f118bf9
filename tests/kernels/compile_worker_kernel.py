"""A module-level Triton kernel that spawned compile workers can import by name (real JIT, not the
interpreter the tests otherwise run)."""

import os
from unittest import mock

import triton
import triton.language as tl

with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}):

    @triton.jit
    def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SMALL_BLOCKS_ONLY: tl.constexpr):
        if SMALL_BLOCKS_ONLY:
            tl.static_assert(BLOCK <= 32, "this variant does not compile")
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)
