"""The pass pipeline: pass interface, registry, the default pipeline as data, and its runner."""

from .base import PASSES, CompileContext, Pass, PassConfig, PassResult, Stage
from .runner import PipelineEntry, load_pipeline, run_pipeline

__all__ = [
    "PASSES",
    "CompileContext",
    "Pass",
    "PassConfig",
    "PassResult",
    "PipelineEntry",
    "Stage",
    "load_pipeline",
    "run_pipeline",
]
