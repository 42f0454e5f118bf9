"""Typed registries with lazy entries.

A registry maps a name to an object of type ``T``. Entries can be registered eagerly with the
``register`` decorator, or lazily as ``"module:attr"`` strings that are imported on first lookup
(so heavy optional dependencies load only when chosen). Out-of-tree packages add entries through a
Python entry-point group.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, entry_point_group: str | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._entry_point_group = entry_point_group
        self._entry_points_loaded = entry_point_group is None

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries:
                raise KeyError(f"{self.kind} '{name}' is already registered")
            self._entries[name] = obj
            self._lazy.pop(name, None)
            return obj

        return decorator

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``name`` to be imported from ``"package.module:attr"`` on first use."""
        if name not in self._entries:
            self._lazy[name] = target

    def get(self, name: str) -> T:
        if name not in self._entries:
            self._load_entry_points()
        if name not in self._entries and name in self._lazy:
            module_name, _, attr = self._lazy[name].partition(":")
            module = importlib.import_module(module_name)
            if name not in self._entries:  # importing may have registered it with the decorator
                self._entries[name] = getattr(module, attr)
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} '{name}'; known: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(set(self._entries) | set(self._lazy))

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self._entry_point_group):
            self.register_lazy(ep.name, ep.value)
