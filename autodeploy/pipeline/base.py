"""The pass interface.

A pass is a registered class with a stage, declared ``requires``/``ensures`` properties, a pydantic
config (``extra="forbid"``) and an ``apply`` method working on a :class:`CompileContext`. Passes
that change how parameters must be materialized (fusion, quantization) register load hooks on
``ctx.weight_hooks`` instead of touching weights; ``load_weights`` runs the hooks. Sharding
registers ``ctx.weight_slices``: which part of a checkpoint tensor this rank reads at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import fx
from transformers import PretrainedConfig

from ..config import CompileConfig
from ..model_loading import Checkpoint
from ..registry import Registry


class Stage(IntEnum):
    """Pipeline stages, in execution order."""

    CANONICALIZE = 1
    QUANTIZE = 2
    SHARD = 3
    FUSE = 4
    LOAD_WEIGHTS = 5
    CACHE_INIT = 6
    COMPILE = 7


class PassConfig(BaseModel):
    """Base config of every pass; subclasses add fields."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True


@dataclass
class PassResult:
    matches: int = 0
    detail: str = ""


LoadHook = Callable[[torch.Tensor], None]


@dataclass
class CompileContext:
    """What passes read and change while a model compiles."""

    gm: fx.GraphModule
    hf_config: PretrainedConfig
    config: CompileConfig
    device: torch.device
    dtype: torch.dtype
    checkpoint: Checkpoint | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # real values of non-persistent buffers
    # checkpoint tensor name -> consumers; a name without hooks is copied into the parameter it names
    weight_hooks: dict[str, list[LoadHook]] = field(default_factory=dict)
    # parameters that hooks build (e.g. fused GEMM weights) -> "has every piece arrived?"
    hook_targets: dict[str, Callable[[], bool]] = field(default_factory=dict)
    # checkpoint tensor name -> the part this process loads (tensor parallelism: a rank's shard), read
    # from a lazy safetensors slice or a whole tensor, before any load hook sees it
    weight_slices: dict[str, Callable[[Any], torch.Tensor]] = field(default_factory=dict)
    properties: set[str] = field(default_factory=lambda: {"exported"})
    history: list[str] = field(default_factory=list)
    artifacts: dict[str, Any] = field(default_factory=dict)  # pass outputs: kv specs, capacity, ...
    dump_dir: Path | None = None

    def add_weight_hook(self, source_name: str, hook: LoadHook) -> None:
        self.weight_hooks.setdefault(source_name, []).append(hook)


class Pass(ABC):
    """Base class of pipeline passes."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    requires: ClassVar[tuple[str, ...]] = ()
    ensures: ClassVar[tuple[str, ...]] = ()
    Config: ClassVar[type[PassConfig]] = PassConfig

    def __init__(self, config: PassConfig):
        self.config = config

    @abstractmethod
    def apply(self, ctx: CompileContext) -> PassResult:
        """Run the pass on ``ctx`` (mutating ``ctx.gm`` and friends)."""


PASSES: Registry[type[Pass]] = Registry("pass", entry_point_group="autodeploy.passes")
