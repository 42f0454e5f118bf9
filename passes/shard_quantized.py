"""Tensor parallelism of the parameters that the quantize pass's load hooks build (quantized
linears: weights, scales, stacked gate/up GEMMs), through its ``ParameterWriter``.

The writer fills a parameter from *logical* tensors (as the checkpoint names them), each into its
rows. Sharding rewrites each slot for this rank: its rows become the rank's rows of the local
parameter (a stacked gate/up parameter holds the rank's gate rows, then its up rows) and the
logical tensor is cut the same way as the parameter:

- stored quantized tensors are cut as they are read (``ctx.weight_slices``: a safetensors lazy
  slice, so a rank reads only its shard);
- online FP8 cuts the unquantized weight as it is read where the result does not depend on the
  other ranks' part (column-parallel: per-channel scales are per row);
- otherwise (online row-parallel FP8: a row's scale spans every input feature; online NVFP4: one
  global scale per tensor) the whole weight is read and quantized, and the writer keeps the rank's
  piece (``Slot.take``): the same numbers as one process, at the cost of reading the whole tensor.

A logical tensor with one value broadcast over its rows (a per-tensor scale of a stacked part) is
not cut; it fills the rank's rows.
"""

from __future__ import annotations

import dataclasses
import functools

from autodeploy.pipeline.base import CompileContext
from autodeploy.quantization.params import ParameterWriter, Slot

from .shard_linears import ParamShard, Part, read_parts
from .shard_split import ShardError


def written_params(ctx: CompileContext) -> set[str]:
    """The parameters the quantize pass's writer builds (empty for an unquantized model)."""
    writer = ctx.artifacts.get("param_writer")
    return writer.params() if writer is not None else set()


def localize_written(ctx: CompileContext, shard: ParamShard, rank: int, world: int) -> None:
    """Point every slot of ``shard``'s parameter at this rank's rows and cut its logical tensor."""
    writer: ParameterWriter = ctx.artifacts["param_writer"]
    for logical, slot in writer.slots_of(shard.name).items():
        rows, parts = _local_rows(shard, slot, rank, world)
        if parts is None:  # one value broadcast over its rows
            writer.slots[logical] = dataclasses.replace(slot, rows=rows)
            continue
        dim = shard.dim
        cut = functools.partial(read_parts, dim=dim, parts=parts, rank=rank, world=world)
        local_shape = list(slot.shape)
        local_shape[dim] = sum(p.size // p.factor for p in parts)
        if _whole_value_needed(writer, shard):
            writer.slots[logical] = dataclasses.replace(slot, rows=rows, take=cut)
            continue
        writer.slots[logical] = dataclasses.replace(slot, rows=rows, shape=tuple(local_shape))
        if writer.online is None or logical in ctx.weight_hooks:  # derived online scales come out local
            ctx.weight_slices[logical] = cut


def _whole_value_needed(writer: ParameterWriter, shard: ParamShard) -> bool:
    """Online quantization whose result on a rank's piece would differ from one process's (module doc)."""
    return writer.online is not None and (writer.online != "fp8" or shard.dim != 0)


def _local_rows(shard: ParamShard, slot: Slot, rank: int, world: int) -> tuple[tuple[int, int] | None, tuple[Part, ...] | None]:
    """(the slot's rows in the rank's parameter, the parts to cut its logical tensor by; None: not cut)."""
    if slot.rows is None:
        if slot.shape != shard.shape:
            raise ShardError(f"{shard.name}: written whole from a tensor of shape {list(slot.shape)}, "
                             f"not its own {list(shard.shape)}")
        return None, shard.parts
    if shard.dim != 0:
        raise ShardError(f"{shard.name}: a stacked parameter cut along its input features")
    start, size = slot.rows[0], slot.rows[1] - slot.rows[0]
    offset = 0
    for part in shard.parts:
        if (part.start, part.size) == (start, size):
            rows = (offset, offset + size // part.factor)
            return rows, (None if slot.shape == () else (Part(0, size, part.factor),))
        offset += part.size // part.factor
    raise ShardError(f"{shard.name}: rows {start}..{start + size} of one of its parts are not one part of the plan")
