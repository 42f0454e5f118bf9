"""Collective ops of tensor parallelism: ``autodeploy::all_reduce`` and ``autodeploy::all_gather``.

The ``shard`` pass inserts them: ``all_reduce`` sums the partial outputs of a row-parallel linear
(attention output, MLP down projection, MoE experts), ``all_gather`` joins the vocabulary slices of
a split LM head. Both name their process group (``autodeploy.distributed`` resolves it), so a graph
stays a plain graph of ops with string arguments. The implementation is torch.distributed's
collective on the device group (NCCL on CUDA, capturable in CUDA graphs; gloo on the CPU); the fake
gives the output shape. Outputs are new tensors: the input (a GEMM's output) is not changed.

On CUDA a small all-reduce may take torch's symmetric-memory one-shot all-reduce instead
(:class:`SymmetricAllReduce`: each rank reads every peer's buffer over NVLink and sums, one kernel,
no NCCL launch). It is off unless switched on (``passes.shard.fast_all_reduce_max_bytes``), and
``bench/probes/tp_decode.py`` measures both.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..distributed import resolve_group

log = logging.getLogger("autodeploy.collectives")
_FAST: dict[str, SymmetricAllReduce] = {}  # group name -> its small-input path, where switched on
# torch 2.13 renamed all_gather_into_tensor (kept, deprecated); 2.11 has only the old name
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.library.custom_op("autodeploy::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``."""
    job = resolve_group(group)
    fast = _FAST.get(group)
    if fast is not None and fast.takes(x):
        return fast(x)
    out = x.clone()
    dist.all_reduce(out, group=job.device_group)
    return out


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order."""
    job = resolve_group(group)
    x = x.contiguous()
    parts = torch.empty((job.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_single(parts, x, group=job.device_group)  # ranks one after the other along dim 0
    return torch.cat(parts.view(job.world_size, *x.shape).unbind(0), dim=dim)


@all_gather.register_fake
def _(x, dim, group):
    shape = list(x.shape)
    shape[dim] = shape[dim] * resolve_group(group).world_size
    return x.new_empty(shape)


class SymmetricAllReduce:
    """torch's one-shot all-reduce over a symmetric-memory buffer of ``max_bytes`` (CUDA, one host).

    ``torch.ops.symm_mem.one_shot_all_reduce_copy`` copies the input into the buffer (rendezvoused
    once, at set-up) and sums every rank's buffer in one kernel; larger inputs, other dtypes and other
    devices take NCCL. One buffer serves every call: the op's own barrier orders a rank's next copy
    after its peers' reads (``bench/probes/tp_decode.py`` checks greedy tokens with the path on).
    """

    def __init__(self, group: dist.ProcessGroup, group_name: str, device: torch.device, dtype: torch.dtype,
                 max_bytes: int):
        from torch.distributed import _symmetric_memory as symm_mem

        self.dtype, self.device = dtype, device
        self.max_numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        log.info("symmetric-memory one-shot all-reduce for inputs up to %d bytes (%s)", max_bytes, group_name)

    def takes(self, x: torch.Tensor) -> bool:
        return x.device == self.device and x.dtype == self.dtype and x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x.contiguous(), "sum", self.group_name)


def enable_fast_all_reduce(dtype: torch.dtype, max_bytes: int) -> bool:
    """Switch the job's small all-reduces to :class:`SymmetricAllReduce`; False (NCCL stays) where
    the job is not on CUDA or symmetric memory cannot be set up."""
    from ..distributed import current

    job = current()
    if job is None or max_bytes <= 0 or job.device.type != "cuda":
        return False
    try:
        _FAST[job.group_name] = SymmetricAllReduce(job.device_group, job.group_name, job.device, dtype, max_bytes)
    except Exception as exc:  # noqa: BLE001 (an optional fast path: NCCL is always correct)
        log.warning("symmetric-memory all-reduce unavailable (%s: %s); every all-reduce takes NCCL",
                    type(exc).__name__, exc)
        return False
    return True
