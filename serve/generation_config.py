"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies them
(``--generation_config auto|vllm|DIR``, ``--override_generation_config JSON``).

Precedence, highest first: what the request sets > ``--override_generation_config`` > the
generation config (``auto``: the model's ``generation_config.json``; ``DIR``: that directory's;
``vllm``: none) > the neutral defaults of the OpenAI API (temperature 1, top_p 1, no top_k...).
Read, as vLLM reads them (through transformers' ``GenerationConfig.to_diff_dict``): ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``, which becomes the ``max_tokens`` of requests that set none (never more than the
context leaves). vLLM's one quirk kept: a ``max_new_tokens`` from ``DIR`` or from the override also
caps the ``max_tokens`` requests set.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autodeploy.errors import ConfigError
from autodeploy.sampling_params import SamplingParams

log = logging.getLogger("autodeploy.serve")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
KEYS = SAMPLING_KEYS + ("max_new_tokens",)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that does not set a sampling parameter gets instead of the API's default."""

    values: Mapping[str, float | int] = field(default_factory=dict)  # of SAMPLING_KEYS
    max_tokens: int | None = None  # of requests that set none
    max_tokens_cap: int | None = None  # of every request (vLLM: DIR's or the override's max_new_tokens)
    source: str = "none"

    def fill(self, body: Any) -> Any:
        """The request ``body`` (a pydantic model) with the defaults where it left a field unset or null."""
        unset = {k: v for k, v in self.values.items()
                 if k not in body.model_fields_set or getattr(body, k, None) is None}
        return body.model_copy(update=unset) if unset else body

    def max_tokens_for(self, requested: int | None, context_left: int) -> int:
        """The completion length of a request that asked for ``requested`` (None: as many as fit)."""
        value = requested if requested is not None else min(context_left, self.max_tokens or context_left)
        return value if self.max_tokens_cap is None else min(value, self.max_tokens_cap)

    def describe(self) -> str:
        shown = {**self.values, **({"max_tokens": self.max_tokens} if self.max_tokens else {})}
        if not shown:
            return f"none ({self.source})"
        return ", ".join(f"{k}={v}" for k, v in shown.items()) + f" ({self.source})"


def load_sampling_defaults(mode: str, model_dir: str | Path, overrides: Mapping[str, Any] | None = None
                           ) -> SamplingDefaults:
    """The defaults ``--generation_config mode`` gives for the model in ``model_dir``."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(KEYS))
    if unknown:
        raise ConfigError(f"--override_generation_config: unknown keys {unknown}; known: {', '.join(KEYS)}")
    if mode == "vllm":
        found, source = {}, "--generation_config vllm"
    else:
        directory = Path(model_dir) if mode == "auto" else Path(mode).expanduser()
        found, source = _read(directory, required=mode != "auto"), str(directory / "generation_config.json")
    merged = {**found, **overrides}
    capping = merged if mode not in ("auto", "vllm") else overrides
    defaults = SamplingDefaults(
        values={k: merged[k] for k in SAMPLING_KEYS if merged.get(k) is not None},
        max_tokens=merged.get("max_new_tokens"),
        max_tokens_cap=capping.get("max_new_tokens"),
        source=source + (" + --override_generation_config" if overrides else ""),
    )
    _check(defaults)
    return defaults


def _read(directory: Path, required: bool) -> dict[str, Any]:
    """The non-default generation parameters of ``directory``'s generation_config.json."""
    from transformers import GenerationConfig

    if not (directory / "generation_config.json").is_file():
        if required:
            raise ConfigError(f"--generation_config {directory}: no generation_config.json there")
        return {}
    try:
        diff = GenerationConfig.from_pretrained(directory).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {directory / 'generation_config.json'}: {exc}") from exc
    return {k: diff[k] for k in KEYS if diff.get(k) is not None}


def _check(defaults: SamplingDefaults) -> None:
    """Defaults every request would fail on are refused at start-up, naming their source."""
    try:
        SamplingParams(max_tokens=defaults.max_tokens, **defaults.values)
        if defaults.max_tokens_cap is not None:
            SamplingParams(max_tokens=defaults.max_tokens_cap)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"generation defaults from {defaults.source}: {exc}") from None
    if defaults.values or defaults.max_tokens:
        log.warning("default sampling parameters from %s: %s (requests that set them win; "
                    "--generation_config vllm ignores the file)", defaults.source, defaults.describe())
