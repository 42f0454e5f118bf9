"""Load the pipeline definition, check its ordering constraints, run it with one log line per pass."""

from __future__ import annotations

import importlib
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import validate
from ..errors import ConfigError, PassError, UnsupportedLayerError
from ..graph.dump import dump_graph
from .base import PASSES, CompileContext, Pass, PassConfig, PassResult

log = logging.getLogger("autodeploy.pipeline")

DEFAULT_PIPELINE = Path(__file__).with_name("default.yaml")
INITIAL_PROPERTIES = frozenset({"exported"})


@dataclass(frozen=True)
class PipelineEntry:
    name: str
    pass_cls: type[Pass]
    config: PassConfig


@dataclass(frozen=True)
class PassRecord:
    name: str
    stage: str
    matches: int
    ms: float
    detail: str
    skipped: bool = False


def _builtin_passes() -> None:
    importlib.import_module("autodeploy.passes")  # registers the in-tree passes lazily


def load_pipeline(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> list[PipelineEntry]:
    """Read a pipeline YAML (default: the built-in one), apply per-pass overrides, check ordering."""
    _builtin_passes()
    file = Path(path) if path else DEFAULT_PIPELINE
    try:
        raw = yaml.safe_load(file.read_text()) or []
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read pipeline {file}: {exc}") from exc
    if not isinstance(raw, list):
        raise ConfigError(f"pipeline {file} must be a list of passes")
    overrides = dict(overrides or {})
    entries = []
    for item in raw:
        if not isinstance(item, dict) or "pass" not in item:
            raise ConfigError(f"pipeline {file}: each entry needs a 'pass' key, got {item!r}")
        settings = {k: v for k, v in item.items() if k != "pass"}
        name = item["pass"]
        settings.update(overrides.pop(name, {}))
        cls = PASSES.get(name)
        entries.append(PipelineEntry(name, cls, validate(cls.Config, settings, f"config of pass '{name}'")))
    if overrides:
        raise ConfigError(f"config given for passes not in the pipeline: {', '.join(sorted(overrides))}")
    check_order(entries)
    return entries


def check_order(entries: list[PipelineEntry]) -> None:
    """Stages never go backwards; every enabled pass's requirements are ensured before it runs."""
    for before, after in zip(entries, entries[1:]):
        if after.pass_cls.stage < before.pass_cls.stage:
            raise ConfigError(
                f"pass '{after.name}' (stage {after.pass_cls.stage.name.lower()}) cannot run after "
                f"'{before.name}' (stage {before.pass_cls.stage.name.lower()})"
            )
    available = set(INITIAL_PROPERTIES)
    for entry in entries:
        if not entry.config.enabled:
            continue
        missing = set(entry.pass_cls.requires) - available
        if missing:
            raise ConfigError(f"pass '{entry.name}' requires {sorted(missing)}, which no earlier enabled pass ensures")
        available |= set(entry.pass_cls.ensures)


def run_pipeline(ctx: CompileContext, entries: list[PipelineEntry]) -> list[PassRecord]:
    records = []
    if ctx.dump_dir:
        dump_graph(ctx.gm, ctx.dump_dir, 0, "exported")
    for index, entry in enumerate(entries, start=1):
        stage = entry.pass_cls.stage.name.lower()
        if not entry.config.enabled:
            records.append(PassRecord(entry.name, stage, 0, 0.0, "disabled", skipped=True))
            log.info("pass %-24s disabled", entry.name)
            continue
        start = time.perf_counter()
        result = _apply(entry, ctx, index)
        ms = (time.perf_counter() - start) * 1e3
        ctx.properties |= set(entry.pass_cls.ensures)
        ctx.history.append(entry.name)
        records.append(PassRecord(entry.name, stage, result.matches, ms, result.detail))
        log.info("pass %-24s matches=%-4d %9.1f ms  %s", entry.name, result.matches, ms, result.detail)
        if ctx.dump_dir:
            dump_graph(ctx.gm, ctx.dump_dir, index, entry.name)
    return records


def _apply(entry: PipelineEntry, ctx: CompileContext, index: int) -> PassResult:
    try:
        return entry.pass_cls(entry.config).apply(ctx)
    except PassError:
        raise
    except UnsupportedLayerError as exc:
        # the user's next step is reading the graph around the layer: dumped even when no dump dir was set
        directory = ctx.dump_dir or Path(tempfile.mkdtemp(prefix="autodeploy-unsupported-"))
        dump = str(dump_graph(ctx.gm, directory, index, f"{entry.name}.failed"))
        raise PassError(entry.name, exc.sentence(dump), list(ctx.history), dump_in_message=True) from exc
    except Exception as exc:
        dump = None
        if ctx.dump_dir:
            dump = str(dump_graph(ctx.gm, ctx.dump_dir, index, f"{entry.name}.failed"))
        raise PassError(entry.name, f"{type(exc).__name__}: {exc}", list(ctx.history), dump) from exc
