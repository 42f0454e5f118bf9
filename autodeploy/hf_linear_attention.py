"""autodeploy as the provider of transformers' chunked gated delta rule: Gated DeltaNet layers export as
``autodeploy::gated_delta_rule``.

Qwen3-Next (and Qwen3.5, OLMo-Hybrid, which share the function) compute their linear attention with
``torch_chunk_gated_delta_rule``: a Python loop over 64-token chunks and, under ``torch.export``, a
64-step forward substitution, unrolled into the graph, which no rewrite rule can sensibly recognise.
transformers has a seam for replacing that function with a kernel, and we cannot use it:

- ``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`` binds the original
  package's function (``fla.ops.gated_delta_rule``) once, when the modeling module is imported, and
  its wrapper calls the torch code whenever ``is_torchdynamo_exporting()`` (5.17 and 5.25 alike): a
  provider installed as ``fla`` is never called during an export;
- the hub route (``kernels.use_kernel_forward_from_hub`` + ``kernelize`` with a kernel mapping) needs
  the ``kernels`` package, whose accepted versions do not overlap between 5.17 (0.16.x) and 5.25
  (0.19.x), a kernel repository built on disk, and, once installed, turns every decorated function
  and layer of every model into a module.

So we provide the function where the layer looks it up: :func:`provide_gated_delta_rule` rebinds the
name ``torch_chunk_gated_delta_rule`` in the modeling module of each of the model's layers that has
it, for the export only (restored afterwards), to :func:`chunk_gated_delta_rule`, FLA's signature
computed by the canonical op. It is a module-attribute patch, scoped and checked: the function it
replaces must have the signature we implement, else the export fails naming it; a call outside what
we implement (an initial state, packed sequences) fails the export too. A Gated DeltaNet layer this
does not reach (another function name, a remote-code model) exports as the unrolled torch code, which
``check_uncached_state`` refuses, naming the layer.
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
    """For the duration of the block, every modeling module of ``model``'s layers that defines
    ``torch_chunk_gated_delta_rule`` calls :func:`chunk_gated_delta_rule` instead (yields their names)."""
    modules = _modules_with_the_function(model)
    originals = {module: getattr(module, HF_NAME) for module in modules}
    for module, original in originals.items():
        _check_signature(module, original)
    try:
        for module in modules:
            setattr(module, HF_NAME, chunk_gated_delta_rule)
        yield [module.__name__ for module in modules]
    finally:
        for module, original in originals.items():
            setattr(module, HF_NAME, original)


def _modules_with_the_function(model: torch.nn.Module) -> list[ModuleType]:
    names = {type(m).__module__ for m in model.modules()}
    modules = [sys.modules.get(name) for name in sorted(names)]
    return [m for m in modules if m is not None and callable(getattr(m, HF_NAME, None))]


def _check_signature(module: ModuleType, function) -> None:
    parameters = tuple(inspect.signature(function).parameters)
    if parameters != HF_PARAMETERS:
        raise ExportError(
            f"{module.__name__}.{HF_NAME} takes {parameters}, not the {HF_PARAMETERS} autodeploy provides "
            "the gated delta rule for: transformers changed the function; autodeploy must follow it")
