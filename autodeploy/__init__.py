"""autodeploy: a JIT graph runtime for LLM inference.

Public API::

    import autodeploy
    model = autodeploy.compile("path/to/checkpoint")          # -> CompiledModel
    llm = autodeploy.LLM("path/to/checkpoint")
    llm.generate(["Hello"], autodeploy.SamplingParams(max_tokens=16))
"""

from typing import Any

from .compiled import CompiledModel
from .compiler import compile
from .config import CompileConfig
from .errors import AutoDeployError
from .sampling_params import RequestOutputKind, SamplingParams, StructuredOutput

__version__ = "0.1.0"

__all__ = ["AutoDeployError", "CompileConfig", "CompiledModel", "LLM", "RequestOutputKind", "SamplingParams",
           "StructuredOutput", "compile", "__version__"]


def __getattr__(name: str) -> Any:
    # The one documented exception to "the core never imports serve": ``autodeploy.LLM`` is the
    # offline face of the serving engine (autodeploy.serve.llm). It is imported lazily, on first
    # use, so importing the core never imports serve.
    if name == "LLM":
        from .serve.llm import LLM

        return LLM
    raise AttributeError(f"module 'autodeploy' has no attribute '{name}'")
