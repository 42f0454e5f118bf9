"""autodeploy as the provider of transformers' chunked gated delta rule (``autodeploy.hf_linear_attention``).

Our function equals transformers' torch code on random inputs (several chunks, grouped or repeated q/k
heads, with and without the l2norm); a real Qwen3-Next Gated DeltaNet layer exported under the route
canonicalizes to ``causal_conv1d`` + ``gated_delta_rule`` + a per-head ``rms_norm``, passes
``check_uncached_state`` and equals HF eager at two token counts; the name is restored afterwards, a
model without the function is left alone, and what the route does not reach, or cannot compute, is refused.
"""

import sys
import types

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from autodeploy.errors import ExportError, PassError
from autodeploy.hf_linear_attention import HF_NAME, chunk_gated_delta_rule, provide_gated_delta_rule
from autodeploy.ops.state_reference import _delta_chunk
from autodeploy.testing import export_for_test, pass_runner
from autodeploy.tiny import tiny_config

ad = torch.ops.autodeploy
HF_CHUNKED = hf_qwen3_next.torch_chunk_gated_delta_rule


def _delta_inputs(tokens: int, key_heads: int = 2, heads: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, tokens, key_heads, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, tokens, heads, 6, generator=gen)
    g = -torch.rand(1, tokens, heads, generator=gen)  # log decay <= 0
    beta = torch.rand(1, tokens, heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("grouped", [True, False], ids=["qk_grouped", "qk_repeated"])
def test_our_function_equals_transformers_torch_code(l2norm, grouped):
    """150 tokens: three chunks of 64. Grouped q/k (2 heads for 4 value heads, as 5.25 passes them) or
    repeated by the layer first (as 5.17 does); transformers' code is run on the repeated heads."""
    q, k, v, g, beta = _delta_inputs(150)
    repeated = [t.repeat_interleave(2, dim=2) for t in (q, k)]
    want, _ = HF_CHUNKED(*repeated, v, g=g, beta=beta, use_qk_l2norm_in_kernel=l2norm)
    got, state = chunk_gated_delta_rule(*((q, k) if grouped else repeated), v, g=g, beta=beta,
                                        use_qk_l2norm_in_kernel=l2norm)
    assert state is None
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("call", [
    {"initial_state": torch.zeros(1, 4, 8, 6)}, {"output_final_state": True}, {"cu_seqlens": torch.tensor([0, 5])},
], ids=["initial_state", "final_state", "packed"])
def test_a_call_with_state_or_packed_sequences_is_refused(call):
    with pytest.raises(ExportError, match="one sequence without a cache"):
        chunk_gated_delta_rule(*_delta_inputs(5), **call)


def _deltanet_layer() -> torch.nn.Module:
    config = tiny_config("qwen3_next")
    torch.manual_seed(0)
    layer = hf_qwen3_next.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in layer.parameters():  # HF leaves the norm weight at ones; random is a sharper test
            param.copy_(torch.randn_like(param) * 0.3)
        layer.A_log.copy_(torch.rand_like(layer.A_log).log())
    return layer


def test_a_gated_deltanet_layer_exports_as_the_state_ops_and_equals_hf_eager():
    """Through transformers' kernel seam where the layer has the wrapper (5.25: ``kernels`` is required),
    through the modeling module's name otherwise (5.17 without ``kernels``), restored afterwards."""
    layer, hf_layer = _deltanet_layer(), _deltanet_layer()  # the same weights; hf_layer is never provided for
    seam = hasattr(layer, "_kernel_funcs")
    with provide_gated_delta_rule(layer) as provided:
        gm = export_for_test(layer, (torch.randn(1, 8, layer.hidden_size),), {0: 1})
    assert provided == (["kernelized:"] if seam else [f"patched:{hf_qwen3_next.__name__}"])
    assert hf_qwen3_next.torch_chunk_gated_delta_rule is HF_CHUNKED
    pass_runner("canonicalize_norms", rules=["match_gated_rms_norm"])(gm)
    pass_runner("canonicalize_state", rules=["match_causal_conv1d"])(gm)
    pass_runner("check_uncached_state")(gm)
    counts = {op: len(gm.graph.find_nodes(op="call_function", target=op.default))
              for op in (ad.gated_delta_rule, ad.causal_conv1d, ad.rms_norm)}
    assert list(counts.values()) == [1, 1, 1], counts
    for tokens in (8, 70):  # 70: two chunks of the op's reference
        x = torch.randn(1, tokens, layer.hidden_size)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), hf_layer(x), atol=1e-5, rtol=1e-4)


def test_a_model_without_the_function_is_left_alone():
    with provide_gated_delta_rule(torch.nn.Linear(4, 4)) as provided:
        assert provided == []


class _UnreachedDeltaNet(torch.nn.Module):
    """A gated delta rule spelled as a remote-code model might (the WY form over all tokens as one chunk,
    not transformers' function): the route does not reach it, so it is exported as it is."""

    def forward(self, x):  # [1, T, 4 * 8]
        q, k, v = (x[0].view(x.shape[1], 4, 8) * s for s in (1.0, 0.5, 2.0))
        g, beta = -x[0, :, :4].sigmoid(), x[0, :, 4:8].sigmoid()
        return _delta_chunk(q, k, v, g, beta, torch.zeros(4, 8, 8))[0].flatten(1)[None]


def test_a_deltanet_the_route_does_not_reach_is_refused_by_check_uncached_state():
    module = _UnreachedDeltaNet()
    with provide_gated_delta_rule(module) as provided:
        gm = export_for_test(module, (torch.randn(1, 6, 32),), {0: 1})
    assert provided == []
    with pytest.raises(PassError, match="check_uncached_state' failed: the layer with state the KV cache does not hold"):
        pass_runner("check_uncached_state")(gm)


def test_a_changed_transformers_function_fails_the_export_naming_it(monkeypatch):
    modeling = types.ModuleType("fake_modeling_deltanet")
    setattr(modeling, HF_NAME, lambda query, key, value, g, beta, scale=None: None)
    layer_class = type("FakeDeltaNet", (torch.nn.Module,), {"__module__": modeling.__name__})
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    with pytest.raises(ExportError, match=r"fake_modeling_deltanet\.torch_chunk_gated_delta_rule takes .*scale"):
        with provide_gated_delta_rule(layer_class()):
            pass


def test_a_changed_function_behind_the_kernel_seam_is_refused():
    """Where transformers wraps the function for ``kernels``, the wrapper's signature is checked (kernelize
    checks a repository's layer only the first time it loads it)."""
    from transformers.utils import is_kernels_available

    if not is_kernels_available():  # (not importorskip: tests/kernels is a namespace package of that name)
        pytest.skip("transformers' kernel seam needs the kernels package (5.25 requires it)")
    import kernels

    @kernels.use_kernel_forward_from_hub("chunk_gated_delta_rule")
    def changed(query, key, value, g, beta, scale=None):
        return value

    @kernels.use_kernelized_func(changed)
    class Layer(torch.nn.Module):
        def forward(self, x):
            return changed(x, x, x, x, x)

    with pytest.raises(ExportError, match=r"the chunk_gated_delta_rule kernel wrapper of Layer takes .*scale"):
        with provide_gated_delta_rule(Layer()):
            pass
