"""Tensor-parallel process groups on torch.distributed (NCCL on CUDA, gloo on the CPU).

Every rank runs the same ``CompiledModel``; the ``shard`` pass gives each its slice of the weights
and inserts ``autodeploy::all_reduce`` / ``all_gather`` ops (``ops/collectives.py``), which find
their process group here by name. Two groups per job:

- the *device group* (NCCL on CUDA, gloo on the CPU) carries the collectives of the model and each
  step's metadata (``distributed_steps.py``); its ``timeout`` bounds every collective;
- the *control group* (gloo, on the host) carries the small per-step header by which rank 0 wakes
  the other ranks. A rank waiting for the next step may wait as long as the server idles, so this
  group has no practical deadline; a peer that dies closes its sockets and the wait fails at once.

:func:`init_tensor_parallel` joins the job: from an explicit store (``autodeploy serve --tp_size N``
spawns its workers that way, see ``serve/tp_workers.py``) or from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...; one host or several).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import ConfigError

log = logging.getLogger("autodeploy.distributed")

DEFAULT_TIMEOUT_S = 600.0  # any collective of the model; compiles on one rank may keep the others waiting
_CONTROL_TIMEOUT = timedelta(days=365)  # waiting for the next step while the server idles
_GROUP_NAME = "autodeploy_tp"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel job."""

    rank: int
    world_size: int
    device: torch.device
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    backend: str

    @property
    def group_name(self) -> str:
        return _GROUP_NAME

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the engine and publishes the steps."""
        return self.rank == 0


_current: TensorParallel | None = None


def current() -> TensorParallel | None:
    """The joined tensor-parallel job, or None (a single process)."""
    return _current


def resolve_group(name: str) -> TensorParallel:
    """The job whose device group the collective ops named ``name`` use."""
    if _current is None or name != _GROUP_NAME:
        raise RuntimeError(f"collective on process group '{name}', but this process has not joined a "
                           "tensor-parallel job (autodeploy.distributed.init_tensor_parallel)")
    return _current


def device_for_rank(device: str, local_rank: int) -> torch.device:
    """``auto``/``cuda`` -> this rank's GPU (``cuda:LOCAL_RANK``) when CUDA is there; else the CPU."""
    if device in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if device == "cuda":
            raise ConfigError("device 'cuda' requested but CUDA is not available")
        return torch.device("cpu")
    return torch.device(device)


def init_tensor_parallel(
    world_size: int,
    rank: int | None = None,
    *,
    device: str = "auto",
    store: dist.Store | None = None,
    local_rank: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TensorParallel:
    """Join (or, when already joined, return) the job of ``world_size`` ranks.

    Without ``store`` the process group comes from torchrun's environment variables, or is the one
    the caller initialized already.
    """
    global _current
    if _current is not None:
        if _current.world_size != world_size:
            raise ConfigError(f"tp_size {world_size}, but this process joined a job of {_current.world_size} ranks")
        return _current
    local_rank = int(os.environ.get("LOCAL_RANK", rank or 0)) if local_rank is None else local_rank
    resolved = device_for_rank(device, local_rank)
    backend = "nccl" if resolved.type == "cuda" else "gloo"
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    else:  # the ranks of one host share its cores: each takes its share of intra-op threads
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // world_size)))
    if not dist.is_initialized():
        _init_default_group(world_size, rank, backend, store, timeout_s, resolved)
    if dist.get_world_size() != world_size:
        raise ConfigError(f"tp_size {world_size}, but the process group has {dist.get_world_size()} ranks "
                          "(tensor parallelism spans the whole job)")
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _current = TensorParallel(dist.get_rank(), world_size, resolved, dist.group.WORLD, control, backend)
    log.info("tensor parallel: rank %d of %d on %s (%s)", _current.rank, world_size, resolved, backend)
    return _current


def _init_default_group(world_size: int, rank: int | None, backend: str, store, timeout_s: float,
                        device: torch.device) -> None:
    timeout = timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        return
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"tp_size {world_size} needs {world_size} processes: run `autodeploy serve --tp_size {world_size}` "
            f"(which starts them), or start this program with `torchrun --nproc-per-node {world_size}`")
    dist.init_process_group(backend, init_method="env://", timeout=timeout, **kwargs)


def shutdown_tensor_parallel() -> None:
    """Leave the job (destroys the process groups)."""
    global _current
    if _current is not None and dist.is_initialized():
        dist.destroy_process_group()
    _current = None


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` of any rank (e.g. KV blocks: every rank must hold the same pool)."""
    if _current is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_current.control_group)
    return int(tensor.item())


def gather_to_driver(obj: object) -> list[object] | None:
    """Every rank's ``obj`` on rank 0 (in rank order); None on the other ranks."""
    if _current is None:
        return [obj]
    out = [None] * _current.world_size if _current.is_driver else None
    dist.gather_object(obj, out, dst=0, group=_current.control_group)
    return out
