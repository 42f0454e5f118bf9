"""Choosing a paged-attention backend by name: defaults, availability, unsupported features."""

import pytest
import torch

from autodeploy.errors import ConfigError
from autodeploy.ops.attention_backends import ATTENTION_BACKENDS, default_backend, resolve_attention_backend


def test_auto_is_torch_on_cpu():
    assert default_backend(torch.device("cpu")) == "torch"
    assert resolve_attention_backend("auto", torch.device("cpu")).op == torch.ops.autodeploy.paged_attention.default


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    assert resolve_attention_backend("triton", torch.device("cpu")).name == "triton"  # TRITON_INTERPRET=1 in tests
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_attention_backend("triton", torch.device("cpu"))


def test_flashinfer_is_refused_on_cpu_and_unknown_names_list_the_known():
    with pytest.raises(ConfigError, match="flashinfer"):
        resolve_attention_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ConfigError, match="known: flashinfer, torch, triton"):
        resolve_attention_backend("xformers", torch.device("cpu"))


def test_unsupported_features_fail_at_compile_time():
    flashinfer = ATTENTION_BACKENDS.get("flashinfer")
    flashinfer.check_layer(128, {"sliding_window": 4096, "logit_softcap": 50.0}, "layer0")
    with pytest.raises(ConfigError, match="sinks"):
        flashinfer.check_layer(128, {"sinks": object()}, "layer0")
    with pytest.raises(ConfigError, match="head dims"):
        flashinfer.check_layer(80, {}, "layer0")
    # FlashInfer has no chunk mask, and its ALiBi slopes are its own: refused before anything runs
    with pytest.raises(ConfigError, match="does not support chunk_size"):
        flashinfer.check_layer(128, {"chunk_size": 8192}, "layer0")
    with pytest.raises(ConfigError, match="does not support alibi_slopes"):
        flashinfer.check_layer(128, {"alibi_slopes": object()}, "layer0")
    for name in ("triton", "torch"):
        ATTENTION_BACKENDS.get(name).check_layer(80, {"sinks": object(), "chunk_size": 8, "alibi_slopes": object()},
                                                 "layer0")


def test_only_the_triton_backend_is_capturable_in_cuda_graphs():
    assert {n: ATTENTION_BACKENDS.get(n).capturable for n in ATTENTION_BACKENDS.names()} == {
        "flashinfer": False, "torch": False, "triton": True}  # flashinfer plans on the host every step
