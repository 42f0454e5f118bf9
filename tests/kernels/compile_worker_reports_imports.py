"""Imported only by a compile worker in a test: its import fails with what the worker has imported."""

import sys

import autodeploy.kernels.gemv  # noqa: F401  (a kernel module imports as it would for a real compile)

raise ImportError(f"transformers: {'transformers' in sys.modules}, "
                  f"compile: {hasattr(sys.modules['autodeploy'], 'compile')}")
