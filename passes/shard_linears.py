"""How a linear layer's parameters are cut for tensor parallelism: the weight, the bias, and the
scales of quantized linears (``fp8_linear``, ``nvfp4_linear`` and their fused variants).

Column-parallel (output features): the weight, the bias and every scale with one entry per output
row (per-channel FP8 scales, NVFP4's block scales, stacked global scales) are cut by rows, a block
scale ``[ceil(N / bn), ceil(K / bk)]`` by whole block rows; per-tensor scales stay whole.
Row-parallel (input features): the weight (NVFP4: its packed bytes, two features each) and its 2-d
scales (block scales, NVFP4's per-16 scales) are cut by columns in proportion; the bias and per-
channel or per-tensor scales stay whole. A cut that does not fall on a block (an FP8 block, an
NVFP4 group of 16, a packed byte) is an error naming the tensor and the tp size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from .shard_split import ShardError, is_param, linear_parts, val


@dataclass(frozen=True)
class Part:
    """``size`` entries from ``start`` along a sharded dimension, cut into ``factor`` equal blocks;
    rank r of ``world`` holds block ``r * factor // world`` (fewer blocks than ranks: replicated)."""

    start: int
    size: int
    factor: int

    def local(self, rank: int, world: int) -> tuple[int, int]:
        block = self.size // self.factor
        return self.start + (rank * self.factor // world) * block, block


@dataclass(frozen=True)
class ParamShard:
    """One parameter (named as in the checkpoint) sliced along ``dim``; ``role`` says why."""

    name: str
    role: str  # column | row | expert | vocab | head
    shape: tuple[int, ...]
    dim: int
    parts: tuple[Part, ...]

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = sum(p.size // p.factor for p in self.parts)
        return tuple(shape)

    def read(self, source, rank: int, world: int) -> torch.Tensor:
        """This rank's slice of ``source``: a safetensors lazy slice (only the slice is read) or a tensor."""
        shape = source_shape(source)
        if shape != self.shape:
            raise RuntimeError(f"{self.name}: checkpoint shape {shape} != planned {self.shape}")
        return read_parts(source, self.dim, self.parts, rank, world)


def source_shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def read_parts(source, dim: int, parts: tuple[Part, ...], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s blocks of ``parts`` along ``dim`` of ``source`` (a lazy slice or a tensor), in order."""
    pieces = []
    for start, length in (p.local(rank, world) for p in parts):
        index = [slice(None)] * len(source_shape(source))
        index[dim] = slice(start, start + length)
        pieces.append(source[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def column_params(linear: fx.Node, parts: tuple[Part, ...], world: int) -> list[ParamShard]:
    """Weight, bias and scales of ``linear`` along its output features, part by part (module doc)."""
    args = linear_parts(linear)
    shards = []
    for key, arg in args.items():
        if key == "input" or not is_param(arg):
            continue
        shape = tuple(val(arg).shape)
        if math.prod(shape) == 1 and key not in ("weight", "bias"):
            continue  # one value for the whole tensor
        rows, _ = entry_size(args, key, shape, _in_features(args))
        if not shape or len(shape) > 2 or rows is None:
            raise ShardError(f"{linear.name}: cannot shard its {key} of shape {list(shape)} by output features")
        shards.append(ParamShard(str(arg.target), "column", shape, 0, _in_blocks(parts, rows, str(arg.target), world)))
    return shards


def row_params(args: dict[str, object], in_features: int, factor: int, world: int) -> list[ParamShard]:
    """The weight and its 2-d scales along ``in_features`` input features cut in ``factor`` (module doc);
    ``args`` are the op's arguments by name (``linear_parts``)."""
    shards = []
    for key, arg in args.items():
        if key in ("input", "bias") or not is_param(arg) or val(arg).dim() != 2:
            continue
        shape, name = tuple(val(arg).shape), str(arg.target)
        _, cols = entry_size(args, key, shape, in_features)
        if cols is None or -(-in_features // cols) != shape[1]:
            raise ShardError(f"{name}: shape {list(shape)} does not cover {in_features} input features")
        if in_features % (cols * factor):
            raise ShardError(f"{name}: tp_size {world} cuts its {in_features} input features into slices of "
                             f"{in_features / factor:g}, not a whole number of its {_what(args, key, cols)}; "
                             "choose a tp_size that does")
        shards.append(ParamShard(name, "row", shape, 1, (Part(0, shape[1], factor),)))
    return shards


def entry_size(args: dict[str, object], key: str, shape: tuple[int, ...], in_features: int) -> tuple[int | None, int | None]:
    """(output rows, input features) one entry of parameter ``key`` covers; None where it does not
    divide them. A block scale's entries are the op's ``block_size`` (its last block may be partial)."""
    block = args.get("block_size")
    if key != "weight" and block and len(shape) == 2:
        return int(block[0]), int(block[1])
    out_features = int(val(args["weight"]).shape[0])
    rows = out_features // shape[0] if shape and out_features % shape[0] == 0 else None
    cols = in_features // shape[1] if len(shape) == 2 and in_features % shape[1] == 0 else None
    return rows, cols


def _in_features(args: dict[str, object]) -> int:
    return int(val(args["input"]).shape[-1])


def _in_blocks(parts: tuple[Part, ...], block: int, name: str, world: int) -> tuple[Part, ...]:
    """``parts`` counted in entries of ``block`` rows: each rank's slice must be whole entries."""
    if block == 1:
        return parts
    for p in parts:
        if p.start % block or p.size % (block * p.factor):
            raise ShardError(f"{name}: tp_size {world} cuts rows {p.start}..{p.start + p.size} into slices of "
                             f"{p.size / p.factor:g}, not a whole number of its {block}-row blocks; choose a "
                             "tp_size that does")
    return tuple(Part(p.start // block, p.size // block, p.factor) for p in parts)


def _what(args: dict[str, object], key: str, cols: int) -> str:
    nvfp4 = val(args["weight"]).dtype == torch.uint8
    if key == "weight":
        return "packed bytes (two e2m1 features each)" if nvfp4 else "features"
    return f"{cols}-feature NVFP4 groups" if nvfp4 else f"{cols}-feature blocks"
