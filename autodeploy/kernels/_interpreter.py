"""Compatibility of Triton's CPU interpreter with NumPy >= 2.4 (used only under TRITON_INTERPRET=1).

The interpreter holds scalars as 1-element arrays and converts them with ``int(array)`` when a
kernel uses a run-time value as a ``range`` bound; NumPy 2.4 refuses ``int()`` of a 1-d array. The
patch converts through ``.item()`` instead; compiled kernels on a GPU never go through this path.
"""

from __future__ import annotations


def patch_scalar_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_autodeploy_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._autodeploy_patched = True
    interpreter._patch_lang_tensor = patched
