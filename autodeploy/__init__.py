"""autodeploy: a JIT graph runtime for LLM inference.

Public API::

    import autodeploy
    model = autodeploy.compile("path/to/checkpoint")          # -> CompiledModel
    llm = autodeploy.LLM("path/to/checkpoint")
    llm.generate(["Hello"], autodeploy.SamplingParams(max_tokens=16))
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["AutoDeployError", "CompileConfig", "CompiledModel", "LLM", "RequestOutputKind", "SamplingParams",
           "StructuredOutput", "compile", "__version__"]

# Imported on first use, so that ``import autodeploy.cli`` (``autodeploy --help``) does not import torch.
# ``autodeploy.LLM`` is the one documented exception to "the core never imports serve": it is the
# offline face of the serving engine (autodeploy.serve.llm), and importing the core never imports serve.
_LAZY = {
    "AutoDeployError": ".errors", "CompileConfig": ".config", "CompiledModel": ".compiled", "compile": ".compiler",
    "RequestOutputKind": ".sampling_params", "SamplingParams": ".sampling_params",
    "StructuredOutput": ".sampling_params", "LLM": ".serve.llm",
}

if TYPE_CHECKING:
    from .compiled import CompiledModel
    from .compiler import compile
    from .config import CompileConfig
    from .errors import AutoDeployError
    from .sampling_params import RequestOutputKind, SamplingParams, StructuredOutput
    from .serve.llm import LLM


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autodeploy' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
