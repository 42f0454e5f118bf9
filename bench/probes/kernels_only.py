"""Import autodeploy's kernels without ``autodeploy/__init__`` (which needs transformers).

Bench scripts that only compile or time kernels import this module first: it registers a bare
``autodeploy`` package over the source tree, so ``autodeploy.kernels`` (and the ops) import alone.
"""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is in bench/probes/)

if "autodeploy" not in sys.modules:
    _pkg = types.ModuleType("autodeploy")
    _pkg.__path__ = [str(ROOT / "autodeploy")]
    sys.modules["autodeploy"] = _pkg
