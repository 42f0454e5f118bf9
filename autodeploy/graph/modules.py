"""Which HF module a graph node came from (export's ``nn_module_stack``), for messages and checks.

Paths are the HF model's own (``model.layers.0.self_attn``): the export wrapper's prefix is removed.
"""

from __future__ import annotations

from typing import Iterable

from torch import fx

_WRAPPER_CLASS = "FlatTokens"  # autodeploy.export's wrapper: its attribute ``model`` is the HF model
_WRAPPER_ATTR = "model"
_NO_MODULE = "_empty_nn_module_stack"  # what export records for nodes it made outside any module


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """``(module path, class name)`` from the outermost module to the innermost one."""
    return [(path, qualified.rsplit(".", 1)[-1]) for path, qualified in _entries(node)]


def layer_of(node: fx.Node) -> tuple[str, str] | None:
    """``(path, class name)`` of the innermost module around ``node`` that is the model's own (not a
    ``torch.nn`` building block such as ``Linear``), or None when the node has no module stack."""
    entries = _entries(node)
    own = [entry for entry in entries if not entry[1].startswith("torch.nn.")] or entries
    if not own:
        return None
    path, qualified = own[-1]
    return path, qualified.rsplit(".", 1)[-1]


def layers_of(nodes: Iterable[fx.Node]) -> list[str]:
    """``"path (Class)"`` of the modules :func:`layer_of` finds for ``nodes``, in order, each once;
    a module inside another one listed (``experts.act_fn`` in ``experts``) counts as that one."""
    layers = dict.fromkeys(layer for layer in map(layer_of, nodes) if layer is not None)
    paths = {path for path, _ in layers}
    outermost = [(path, cls) for path, cls in layers if not any(_inside(path, other) for other in paths)]
    return [f"{path or '<root>'} ({cls})" for path, cls in outermost]


def _inside(path: str, other: str) -> bool:
    return other != "" and path.startswith(other + ".")  # the root module holds no layer


def _entries(node: fx.Node) -> list[tuple[str, str]]:
    """``(path, qualified class name)`` outermost first, the export wrapper removed."""
    stack = (node.meta.get("nn_module_stack") or {}).values()
    entries = [(path, _qualified_name(cls)) for path, cls in stack if not path.startswith(_NO_MODULE)]
    if entries and entries[0][1].endswith("." + _WRAPPER_CLASS):
        entries = [(_unwrapped(path), cls) for path, cls in entries[1:]]
    return entries


def _unwrapped(path: str) -> str:
    if path == _WRAPPER_ATTR:
        return ""
    return path[len(_WRAPPER_ATTR) + 1 :] if path.startswith(_WRAPPER_ATTR + ".") else path


def _qualified_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)
