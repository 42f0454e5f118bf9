import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels are tested on the CPU through the interpreter (must be set before kernels are defined)
os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (CI runs `-n 2`), each worker gets its share of the cores: tiny models gain
# nothing from intra-op threads, and two workers with a thread per core each would oversubscribe.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import autodeploy.ops  # noqa: F401  (registers the canonical ops: `import autodeploy` is lazy)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (real HF modeling code), shared by the session."""
    from autodeploy.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))
