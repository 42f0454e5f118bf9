"""What the tests of this folder share: they need a CUDA device and Triton's real JIT. tests/conftest.py turns
Triton's interpreter on unless told otherwise, so run them as

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests                      # every gpu test of the project
    TRITON_INTERPRET=0 python -m pytest -q -m "gpu and not slow" tests/gpu   # the kernels and ops (~4 min)
    TRITON_INTERPRET=0 python -m pytest -q -m "gpu and slow" tests/gpu       # the models (~8 min)

On a GPU machine with autodeploy installed by ``bench/run.sh``: ``bash bench/run.sh tests [PYTEST ARGS]``.

Without CUDA (CI) every test here is skipped. The paged batches come from ``bench/kernel_bench.py``, which
times the same kernels.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

ON_CUDA = [pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                              reason="needs a CUDA device and TRITON_INTERPRET=0")]
BF16_TOL = 1e-2  # ||got - want|| / ||want|| of a bf16 kernel against its fp32-accumulating reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
