"""The JIT specialization key of a Triton launch, computed on the host: which launches compile.

Triton compiles a kernel once per key: its constexprs, the launch options (``num_warps``, ...) and
what it specializes the other arguments on (an int equal to 1 or divisible by 16, a pointer aligned
to 16 bytes), unless the kernel marks them ``do_not_specialize`` / ``do_not_specialize_on_alignment``.
:func:`recording_keys` swaps a module's kernel for a recorder that computes each launch's key with
Triton's own binder for an sm_90 target (no GPU, no driver: the addresses of CPU tensors stand for
device ones, whose alignment follows the same offsets) and launches nothing. Tests compare the keys
an engine's steps produce with those its start-up warm-up produces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)

LaunchKey = tuple[tuple, tuple]  # (Triton's specialization of each argument, the launch options)


@contextmanager
def recording_keys(module, name: str) -> Iterator[list[LaunchKey]]:
    """Inside, ``module.<name>[grid](...)`` launches nothing and appends its key to the yielded list."""
    kernel = getattr(module, name)
    jit = as_jit_function(kernel)
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(SM90))
    keys: list[LaunchKey] = []

    class _Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _, specialization, options = binder(*args, **kwargs)
                keys.append((tuple(specialization), tuple(sorted(options.items()))))
            return launch

    setattr(module, name, _Recorder())
    try:
        yield keys
    finally:
        setattr(module, name, kernel)


def as_jit_function(kernel) -> JITFunction:
    """The kernel as a JITFunction (under ``TRITON_INTERPRET=1`` it is an interpreter's function, which
    keeps the decorator's arguments: ``do_not_specialize`` and the others)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)
