"""Fixtures of the tensor-parallel tests: tiny checkpoints, and the serving tests' tokenizer."""

import importlib.util
from pathlib import Path

import pytest


def _serve_fixtures():
    """tests/serve/conftest.py as a module (its tokenizer trainer is reused, not copied)."""
    spec = importlib.util.spec_from_file_location("serve_fixtures", Path(__file__).parents[1] / "serve" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_served(tmp_path_factory):
    """A tiny Llama with a BPE tokenizer and chat template (as the serving tests use)."""
    from autodeploy.tiny import make_tiny_checkpoint

    fixtures = _serve_fixtures()
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tp_llama"), vocab_size=fixtures.VOCAB_SIZE)
    fixtures.train_tokenizer(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """The tiny references run with one intra-op thread, as the ranks beside them do (2-core CI)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
