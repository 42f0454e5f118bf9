"""autodeploy: a JIT graph runtime for LLM inference.

Public API::

    import autodeploy
    model = autodeploy.compile("path/to/checkpoint")          # -> CompiledModel
    llm = autodeploy.LLM("path/to/checkpoint")
    llm.generate(["Hello"], autodeploy.SamplingParams(max_tokens=16))
"""

from .compiled import CompiledModel
from .compiler import compile
from .config import CompileConfig
from .errors import AutoDeployError
from .llm import LLM, SamplingParams

__version__ = "0.1.0"

__all__ = ["AutoDeployError", "CompileConfig", "CompiledModel", "LLM", "SamplingParams", "compile", "__version__"]
