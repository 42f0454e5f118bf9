"""token_flow proves ops token-local on symbolic shapes: every way of mixing tokens is found, layers
that keep them apart pass, and an op it does not know is reported rather than trusted."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from autodeploy.errors import PassError
from autodeploy.graph.token_flow import token_mixing
from autodeploy.graph.cleanup import cleanup_graph
from autodeploy.testing import pass_runner

HIDDEN = 8


class Layer(torch.nn.Module):
    """``x[T, H]`` (and the positions) -> ``[T, H]`` through ``fn``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.conv = torch.nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, groups=HIDDEN, padding=2)
        self.table = torch.nn.Embedding(64, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, x, positions):
        return self.fn(self, self.proj(x), positions)


def _causal_conv(m, x, positions):
    return m.conv(x.transpose(0, 1)[None])[0, :, : x.shape[0]].transpose(0, 1)


def _chunked(m, x, positions):
    pad = (4 - x.shape[0] % 4) % 4
    chunks = F.pad(x, (0, 0, 0, pad)).view(-1, 4, HIDDEN)
    return chunks.cumsum(dim=1).view(-1, HIDDEN)[: x.shape[0]]


MIXING = {
    "cumsum over tokens": (lambda m, x, p: x.cumsum(dim=0), "works along the token dimension"),
    "causal convolution": (_causal_conv, "convolves over the token dimension"),
    "token shift": (lambda m, x, p: torch.cat([x.new_zeros(1, HIDDEN), x[:-1]]), "pads or splits"),
    "mean over tokens": (lambda m, x, p: x - x.mean(dim=0, keepdim=True), "works along the token dimension"),
    "dot products of token pairs, summed": (lambda m, x, p: x * (x.T @ x).sum(), "contracts over the token"),
    "flipped tokens": (lambda m, x, p: x.flip(0), "works along the token dimension"),
    "row index as a value": (lambda m, x, p: x * torch.arange(x.shape[0])[:, None], "row in the step"),
    "token count as a value": (lambda m, x, p: x / x.shape[0], "number of tokens in the step"),
    "token count as an index": (lambda m, x, p: x * torch.cat([x, x], dim=1)[:, x.shape[0]:][:, :HIDDEN],
                                "number of tokens in the step"),
    "uncanonicalized attention": (lambda m, x, p: torch.softmax(x @ x.T, dim=-1) @ x, "pairs of tokens"),
    "chunked scan": (_chunked, "pads or splits the token dimension"),
    "rows sorted by value": (lambda m, x, p: x[x[:, 0].argsort()], "works along the token dimension"),
    "unknown op": (lambda m, x, p: torch.fft.rfft(x, dim=-1).abs()[:, :HIDDEN // 2].repeat(1, 2),
                   "whose effect on tokens is not known"),
}

TOKEN_LOCAL = {
    "norm and GELU": lambda m, x, p: F.gelu(m.norm(x)),
    "position lookup and heads reshaped": lambda m, x, p: (
        (x + m.table(p)).view(-1, 2, HIDDEN // 2).transpose(0, 1).softmax(-1).transpose(0, 1).reshape(-1, HIDDEN)),
    "top-k over features": lambda m, x, p: x * torch.zeros_like(x).scatter(1, x.topk(2, dim=-1).indices, 1.0),
    "gather over features": lambda m, x, p: x.gather(1, x.argsort(dim=-1)),
    "sum over features": lambda m, x, p: x - x.sum(-1, keepdim=True),
    "complex rotation (Llama-4's RoPE)": lambda m, x, p: torch.view_as_real(
        torch.view_as_complex(x.float().reshape(x.shape[0], -1, 2))
        * torch.polar(torch.ones(x.shape[0], HIDDEN // 2), p[:, None].float() * 0.1)).reshape(x.shape[0], HIDDEN),
}


def _attention_with_sinks(m, x, p):
    q = x.view(1, -1, 2, HIDDEN // 2)
    return torch.ops.autodeploy.attention(q, q, q, 0.5, True, 4, None, sinks=m.norm.weight[:2]).reshape(-1, HIDDEN)


def _mla(m, x, p):
    """Two heads: nope and rotary halves of 2, a latent of 4 and a rotary key of 2, values of 2."""
    heads = x.view(1, -1, 2, HIDDEN // 2)
    out = torch.ops.autodeploy.mla(heads[..., :2], heads[..., 2:], x[None, :, :4], x[None, :, 6:],
                                   m.proj.weight[:, :4], 0.5)
    return out.reshape(-1, HIDDEN // 2).repeat(1, 2)


# canonical ops whose history the cache keeps (``SEQUENCE_OPS``): they mix tokens, and are allowed to
SEQUENCE = {"attention with sinks and a window": _attention_with_sinks, "multi-head latent attention": _mla}


def _export(module, tokens: int = 6):
    """Exported as the compiler does (``Dim.DYNAMIC``: a ranged Dim rejects guards such as T != 1)."""
    inputs = (torch.randn(tokens, HIDDEN), torch.arange(tokens))
    dims = ({0: Dim.DYNAMIC}, {0: Dim.DYNAMIC})
    with torch.no_grad():
        return cleanup_graph(torch.export.export(module.eval(), inputs, dynamic_shapes=dims, strict=False).module())


def _graph(fn):
    return _export(Layer(fn))


@pytest.mark.parametrize("name", MIXING)
def test_token_mixing_is_found(name):
    fn, why = MIXING[name]
    found = token_mixing(_graph(fn))
    assert found, f"{name}: nothing found"
    assert why in found[0][1], found[0][1]


@pytest.mark.parametrize("name", TOKEN_LOCAL)
def test_token_local_layers_pass(name):
    assert token_mixing(_graph(TOKEN_LOCAL[name])) == []


@pytest.mark.parametrize("name", SEQUENCE)
def test_canonical_sequence_ops_pass(name):
    assert token_mixing(_graph(SEQUENCE[name])) == []


def test_dead_code_is_not_judged():
    def fn(m, x, p):
        _unused = x.cumsum(dim=0)
        return x + 1

    assert token_mixing(_graph(fn)) == []


def test_the_pass_refuses_a_cumulative_sum_over_tokens_naming_the_module():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mixer = Layer(lambda m, x, p: x.cumsum(dim=0))

        def forward(self, x, positions):
            return self.mixer(x, positions)

    gm = _export(Model())
    with pytest.raises(PassError, match=r"check_uncached_state' failed: the layer with state the KV cache does not "
                                        r"hold in mixer \(Layer\) is not supported: .*cumsum works along the token"):
        pass_runner("check_uncached_state")(gm)


def test_the_pass_accepts_a_token_local_model():
    result = pass_runner("check_uncached_state")(_graph(TOKEN_LOCAL["norm and GELU"]))
    assert result.matches == 0
