"""FlashInfer (0.6) paged attention behind the autodeploy contract. Optional: imported only when
``attention_backend=flashinfer`` is chosen, and only where ``flashinfer`` imports (CUDA machines).

FlashInfer's plan/run API needs the batch shape on the host, so the first layer of each step plans
(one device-to-host copy of the metadata) and every later layer of the same step reuses that plan.
A step is recognised by the identity *and* version counters of its metadata tensors, so reusing a
static buffer updated in place (``copy_``) also triggers a new plan. Planning is a host operation:
this backend runs eagerly and is not capturable in a CUDA graph (the Triton backend is).
K/V are written into the cache by the Triton cache-write kernel, as in the Triton backend. An FP8
pool (``float8_e4m3fn``) is planned as FlashInfer's FP8 KV cache and run with the per-tensor k/v
scales (FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import flashinfer
import torch

from .kv_cache_write import write_kv_cache

WORKSPACE_BYTES = 128 << 20
_workspaces: dict[torch.device, torch.Tensor] = {}


@dataclass
class _Plan:
    step: tuple  # (weakrefs, versions) of the metadata tensors it was made for
    wrapper: Any
    num_rows: int  # query rows covered (tokens of sequences with query_len > 0)


_plans: dict[tuple, _Plan] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _step_of(tensors: tuple[torch.Tensor, ...]) -> tuple | None:
    try:
        versions = tuple(t._version for t in tensors)
    except RuntimeError:  # inference tensors have no version counter: never reuse a plan
        return None
    return tuple(weakref.ref(t) for t in tensors), versions


def _same_step(plan: _Plan, tensors: tuple[torch.Tensor, ...], step: tuple | None) -> bool:
    if step is None or plan.step is None:
        return False
    refs, versions = plan.step
    return all(r() is t for r, t in zip(refs, tensors)) and versions == step[1]


def _page_lists(query_lens, context_lens, block_table, page_size: int):
    """FlashInfer's CSR page table for the sequences with queries (int32, on the device)."""
    q_host, ctx_host = query_lens.cpu(), context_lens.cpu()  # the one sync of the step
    keep = q_host > 0
    kv_lens = (ctx_host + q_host)[keep]
    pages = (kv_lens + page_size - 1) // page_size
    zero = torch.zeros(1, dtype=torch.int64)
    qo_indptr = torch.cat([zero, q_host[keep].cumsum(0)]).int()
    kv_indptr = torch.cat([zero, pages.cumsum(0)]).int()
    table = block_table[keep.to(block_table.device)]
    columns = torch.arange(table.shape[1], device=table.device)
    indices = table[columns[None, :] < pages.to(table.device)[:, None]].int()
    last_page_len = (kv_lens - (pages - 1) * page_size).int()
    return qo_indptr, kv_indptr, indices, last_page_len, bool((q_host[keep] == 1).all())


def _make_plan(q, kv_cache, query_lens, context_lens, block_table, scale, window, softcap, step) -> _Plan:
    page_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    qo_indptr, kv_indptr, indices, last_len, all_decode = _page_lists(query_lens, context_lens, block_table, page_size)
    device, rows = q.device, int(qo_indptr[-1])
    common = dict(window_left=window - 1 if window else -1, logits_soft_cap=softcap or None,
                  q_data_type=q.dtype, kv_data_type=kv_cache.dtype, sm_scale=scale)
    if all_decode:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD", use_tensor_cores=True)
        wrapper.plan(kv_indptr.to(device), indices, last_len.to(device), q.shape[1], num_kv_heads, head_dim,
                     page_size, pos_encoding_mode="NONE", **common)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD")
        wrapper.plan(qo_indptr.to(device), kv_indptr.to(device), indices, last_len.to(device), q.shape[1],
                     num_kv_heads, head_dim, page_size, causal=True, **common)
    return _Plan(step, wrapper, rows)


def flashinfer_paged_attention(
    q, k, v, kv_cache, query_lens, context_lens, cu_seqlens, block_table, slot_mapping,
    scale: float, sliding_window: int | None, logit_softcap: float | None, k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The contract of ``autodeploy::paged_attention`` (without sinks) on FlashInfer kernels."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    write_kv_cache(k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous(),
                   kv_cache, slot_mapping, out, cu_seqlens, k_scale, v_scale)
    kind = (q.shape[1:], kv_cache.shape[2:], q.dtype, kv_cache.dtype, scale, sliding_window, logit_softcap)
    metadata = (query_lens, context_lens, cu_seqlens, block_table)
    step = _step_of(metadata)
    plan = _plans.get(kind)
    if plan is None or not _same_step(plan, metadata, step):
        plan = _make_plan(q, kv_cache, query_lens, context_lens, block_table, scale,
                          sliding_window, logit_softcap, step)
        _plans[kind] = plan
    if plan.num_rows:
        # sequences with query_len 0 own no rows, so the covered rows are the first num_rows tokens
        scales = dict(k_scale=k_scale, v_scale=v_scale) if kv_cache.dtype == torch.float8_e4m3fn else {}
        plan.wrapper.run(q[: plan.num_rows].contiguous(), kv_cache, out=out[: plan.num_rows], **scales)
    return out
