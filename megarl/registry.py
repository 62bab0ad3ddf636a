"""Named plugin slots (advantage estimators, policy losses, KL estimators, verifiers, rollout functions, rollout
backends): one small class for all, and `load_plugins`, which imports the user modules that fill them.

Pure Python, so that light modules (verifiers, `megarl-verify`) can use it without importing torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@registry.register("grpo")`; registering a name twice is an error."""

        def decorate(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return decorate

    def get(self, name: str) -> T:
        """The item registered as `name`; an unknown name raises ValueError listing the valid ones."""
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def load_plugins(spec: str | Sequence[str]) -> tuple[str, ...]:
    """Import user modules that register plugins (`--plugins mod[,mod...]`): a module name importable from
    `sys.path`, or the path of a `.py` file, whose directory is then put on `sys.path` (worker processes started
    afterwards inherit it). Returns the module names, for worker processes to import in turn. A module that does
    not import raises ValueError naming it and why."""
    names = []
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [s.strip() for s in spec]
    for item in filter(None, items):
        name = item
        if item.endswith(".py") or os.sep in item:
            path = Path(item).resolve()
            if not path.is_file():
                raise ValueError(f"--plugins {item}: no such file")
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))
            name = path.stem
        try:
            importlib.import_module(name)
        except Exception as e:  # a plugin's own error, whatever it is, stops the run here with its name
            raise ValueError(f"--plugins {item}: importing {name!r} failed: {type(e).__name__}: {e}") from None
        names.append(name)
    return tuple(names)
