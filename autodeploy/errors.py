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


_DUMP_HINT = "set AUTODEPLOY_DUMP_DIR=<dir> (or --dump-graphs) to dump every graph"


class PassError(AutoDeployError):
    """A pass failed; the message names the pass, the passes before it and the graph dump
    (``dump_in_message``: the message already says where the dump is)."""

    def __init__(self, pass_name: str, message: str, history: list[str] | None = None, dump: str | None = None,
                 dump_in_message: bool = False):
        parts = [f"pass '{pass_name}' failed: {message}"]
        if history:
            parts.append(f"passes run before it: {', '.join(history)}")
        if not dump_in_message:
            parts.append(f"graph dump: {dump}" if dump else _DUMP_HINT)
        super().__init__("\n  ".join(parts))
        self.pass_name = pass_name


class UnsupportedPatternError(AutoDeployError):
    """A graph contains something the runtime cannot lower (e.g. an attention mask it cannot classify)."""


class QuantizationError(AutoDeployError):
    """A quantized checkpoint (or ``--quantization``) asks for something that cannot be served as
    asked: an unknown scheme, a missing or misshapen scale tensor, a shape that does not split into
    the format's blocks. The message names the scheme and the tensor."""


class UnsupportedLayerError(UnsupportedPatternError):
    """A kind of layer of the HF model that the compiler cannot lower, in the modules named.

    ``sentence(dump)`` is the message a user acts on: which layer kind, in which module of the HF
    model (and how many more like it), why, and where the graph dump is.
    """

    def __init__(self, kind: str, modules: list[str], why: str):
        self.kind, self.modules, self.why = kind, list(modules), why
        super().__init__(self.sentence())

    def sentence(self, dump: str | None = None) -> str:
        where = self.modules[0] if self.modules else "a part of the graph no module claims"
        if len(self.modules) > 1:
            where += f" (and {len(self.modules) - 1} more module{'s' if len(self.modules) > 2 else ''})"
        dump_part = f"the graph is dumped at {dump}" if dump else _DUMP_HINT
        return f"the {self.kind} in {where} is not supported: {self.why}; {dump_part}."
