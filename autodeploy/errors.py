"""Errors raised by autodeploy. Every message says what failed and where to look next."""

from __future__ import annotations


class AutoDeployError(RuntimeError):
    """Base class of all autodeploy errors."""


class ConfigError(AutoDeployError, ValueError):
    """A configuration value or pipeline definition is invalid."""


class ModelLoadError(AutoDeployError):
    """The checkpoint directory cannot be read or built."""


class ExportError(AutoDeployError):
    """torch.export could not capture the model."""


class PassError(AutoDeployError):
    """A pass failed; the message names the pass, the passes before it and the graph dump."""

    def __init__(self, pass_name: str, message: str, history: list[str] | None = None, dump: str | None = None):
        parts = [f"pass '{pass_name}' failed: {message}"]
        if history:
            parts.append(f"passes run before it: {', '.join(history)}")
        parts.append(
            f"graph dump: {dump}" if dump else "set AUTODEPLOY_DUMP_DIR=<dir> (or --dump-graphs) to dump every graph"
        )
        super().__init__("\n  ".join(parts))
        self.pass_name = pass_name


class UnsupportedPatternError(AutoDeployError):
    """A graph contains something the runtime cannot lower (e.g. an attention mask it cannot classify)."""


class QuantizationError(AutoDeployError):
    """A quantized checkpoint (or ``--quantization``) asks for something that cannot be served as
    asked: an unknown scheme, a missing or misshapen scale tensor, a shape that does not split into
    the format's blocks. The message names the scheme and the tensor."""
