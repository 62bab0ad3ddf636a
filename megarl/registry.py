"""Named plugin slots (advantage estimators, policy losses, KL estimators, verifiers): one small class for all.

Pure Python, so that light modules (verifiers, `megarl-verify`) can use it without importing torch.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

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
