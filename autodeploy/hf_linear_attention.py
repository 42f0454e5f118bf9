"""autodeploy as the provider of transformers' chunked gated delta rule: Gated DeltaNet layers export as
``autodeploy::gated_delta_rule``.

Qwen3-Next (and Qwen3.5, OLMo-Hybrid, which share the function) compute their linear attention with
``torch_chunk_gated_delta_rule``: a Python loop over 64-token chunks and, under ``torch.export``, a
64-step forward substitution, unrolled into the graph, which no rewrite rule can sensibly recognise.
transformers routes the function through ``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule",
"fla")``, a seam with two halves:

- the package half binds the original package's function (``fla.ops.gated_delta_rule``) once, when the
  modeling module is imported, and calls the torch code whenever ``is_torchdynamo_exporting()`` (5.17
  and 5.25 alike): a provider installed as ``fla`` is never called during an export;
- the hub half (the ``kernels`` package): each layer's private wrapper of the function
  (``use_kernelized_func``) is replaced by ``kernels.kernelize`` with the layer a kernel mapping names.
  This is the seam we use: our repository (:class:`_Provider`) hands ``kernelize`` a layer computing
  :func:`chunk_gated_delta_rule`, FLA's signature through the canonical op. transformers 5.25 requires
  ``kernels`` (0.19.x), so its layers always have the wrappers.

transformers 5.17 leaves ``kernels`` an optional extra, in a version window (0.16.x) that does not
overlap 5.25's, so a 5.17 install usually has no wrappers (and with kernels 0.16 the layers share the
module's global one, which kernelizing would change for the whole process). There we provide the function where the
layer looks it up instead: the modeling module's global ``torch_chunk_gated_delta_rule`` is rebound to
:func:`chunk_gated_delta_rule` for the export only (restored afterwards); a module-attribute patch,
scoped and checked: the function it replaces must have the signature we implement, else the export
fails naming it. Either way a call outside what we implement (an initial state, packed sequences)
fails the export, and a Gated DeltaNet layer neither reaches (another function, a remote-code model)
exports as its unrolled torch code, which ``check_uncached_state`` refuses, naming the layer.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

from .errors import ExportError

HF_NAME = "torch_chunk_gated_delta_rule"  # the module global Gated DeltaNet layers call
HF_PARAMETERS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel", "kwargs")
L2NORM_EPS = 1e-6  # FLA's (and transformers' torch code's) l2norm epsilon


def chunk_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``torch_chunk_gated_delta_rule`` for one sequence without a cache, through the op.

    query/key [1, T, Hk, K] (Hk divides the value heads: repeated by the layer or not), value
    [1, T, H, V], g (log decay) / beta [1, T, H] -> (out [1, T, H, V] in query's dtype, None). The
    math is fp32 as transformers' (l2norm of q and k when asked, q scaled by K^-1/2); ``chunk_size``
    changes nothing but the work split.
    """
    _refuse_unsupported(query, initial_state, output_final_state, kwargs)
    q, k = query[0].float(), key[0].float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    out = torch.ops.autodeploy.gated_delta_rule(q, k, value[0], g[0], beta[0])
    return out.to(query.dtype)[None], None


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _refuse_unsupported(query, initial_state, output_final_state, kwargs) -> None:
    packed = kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None
    if query.shape[0] != 1 or initial_state is not None or output_final_state or packed:
        raise ExportError(
            f"{HF_NAME} was called with batch {query.shape[0]}, initial_state "
            f"{'set' if initial_state is not None else 'None'}, output_final_state {output_final_state}, packed "
            f"sequences {packed}: autodeploy exports one sequence without a cache (batch 1, no state in or out); "
            "the state pool holds the state between steps")


@contextlib.contextmanager
def provide_gated_delta_rule(model: torch.nn.Module) -> Iterator[list[str]]:
    """While the block runs, ``model``'s Gated DeltaNet layers compute :func:`chunk_gated_delta_rule`.

    Layers with transformers' kernel wrapper are kernelized with our layer (the wrapper keeps it: the
    model is built for the export); the modeling modules of the others that define
    ``torch_chunk_gated_delta_rule`` have the name rebound until the block ends. Yields what was
    provided: ``kernelized:<layer path>`` and ``patched:<module name>`` entries.
    """
    provided = [f"kernelized:{path}" for path in _kernelize_wrappers(model)]
    modules = _modules_with_the_function(model) if not provided else []
    originals = {module: getattr(module, HF_NAME) for module in modules}
    for module, original in originals.items():
        _check_parameters(f"{module.__name__}.{HF_NAME}", tuple(inspect.signature(original).parameters))
    try:
        for module in modules:
            setattr(module, HF_NAME, chunk_gated_delta_rule)
        yield provided + [f"patched:{module.__name__}" for module in modules]
    finally:
        for module, original in originals.items():
            setattr(module, HF_NAME, original)


# ---- the seam: transformers' kernel wrappers (the ``kernels`` package) ------------------------------

KERNEL_NAME = "chunk_gated_delta_rule"  # the wrapper's kernel layer name in transformers


class _DeltaRuleLayer(torch.nn.Module):
    """The layer our repository hands ``kernels.kernelize``: stateless, with the wrapped function's
    signature (``kernelize`` compares the two)."""

    has_backward = False  # inference only

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return chunk_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, **kwargs)


class _Provider:
    """A kernel repository (``kernels``' ``RepositoryProtocol``) that needs no download: our layer."""

    def load(self) -> type[torch.nn.Module]:
        return _DeltaRuleLayer

    def __str__(self) -> str:
        return "autodeploy (the gated_delta_rule op)"


_PROVIDER = _Provider()  # one instance: kernels memoizes the loaded layer per repository


def _kernelize_wrappers(model: torch.nn.Module) -> list[str]:
    """Kernelize every layer's own ``chunk_gated_delta_rule`` wrapper with our layer; their layer paths.

    kernels before 0.19 (transformers 5.17's window) gives the layers the module's global wrapper, not
    one of their own: kernelizing it would change the function for every model of the process, for
    good, so those layers take the scoped rebinding instead."""
    wrappers = {path: m._kernel_funcs[KERNEL_NAME] for path, m in model.named_modules()
                if KERNEL_NAME in getattr(m, "_kernel_funcs", {})
                and m._kernel_funcs[KERNEL_NAME] is not getattr(sys.modules.get(type(m).__module__), HF_NAME, None)}
    if not wrappers:
        return []
    from kernels import Mode, kernelize, use_kernel_mapping

    for path, wrapper in wrappers.items():  # (kernelize checks a repository's layer only once per process)
        _check_parameters(f"the {KERNEL_NAME} kernel wrapper of {path or type(model).__name__}",
                          tuple(inspect.signature(type(wrapper).forward).parameters)[1:])

    with use_kernel_mapping({KERNEL_NAME: {"cpu": _PROVIDER}}, inherit_mapping=False):
        for wrapper in wrappers.values():
            # the device only picks the mapping's entry: the op runs wherever the compiled model does
            kernelize(wrapper, mode=Mode.INFERENCE, device="cpu", use_fallback=False)
    return list(wrappers)


# ---- without the seam: the modeling module's name, for the export only -------------------------------


def _modules_with_the_function(model: torch.nn.Module) -> list[ModuleType]:
    names = {type(m).__module__ for m in model.modules()}
    modules = [sys.modules.get(name) for name in sorted(names)]
    return [m for m in modules if m is not None and callable(getattr(m, HF_NAME, None))]


def _check_parameters(where: str, parameters: tuple[str, ...]) -> None:
    if parameters != HF_PARAMETERS:
        raise ExportError(
            f"{where} takes {parameters}, not the {HF_PARAMETERS} autodeploy provides the gated delta rule "
            "for: transformers changed the function; autodeploy must follow it")
