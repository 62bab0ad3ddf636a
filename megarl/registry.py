"""Named plugin slots (advantage estimators, policy losses, KL estimators, rollout functions, rollout backends,
verifiers, reward models, tools, tool parsers): one `Registry` class for all, and `load_plugins`, which imports
the user modules that fill them.

    VERIFIERS = Registry("verifier", builtins=("megarl.verifiers.arithmetic", "megarl.verifiers.code", ...))

    @VERIFIERS.register("mine", options=MineOptions)   # MineOptions: a dataclass of `option(...)` fields
    class Mine: ...

    VERIFIERS.get("mine"), VERIFIERS.build("mine", **kwargs), VERIFIERS.names(), "mine" in VERIFIERS

A registry knows its built-ins: the modules listed in `builtins` are imported on the first lookup, so importing the
registry is enough to find a built-in entry, and a built-in module may import the registry without a cycle.

An entry may declare its own options: a dataclass whose fields are made with `option(default, help)`. Each field
is a flag of the trainer (`--field-name`), parsed, checked, saved in a run's config.json and printed by `--help`
like megarl's own (`megarl.arguments`); a plugin's options work the same with no edit to megarl. The dataclass
may define `kwargs(self, cfg) -> dict`, the keyword arguments its entry is built with given the whole run config
(to read shared sections such as `cfg.sandbox`); without it the entry gets the fields themselves.

Pure Python, so that light modules (verifiers, `megarl-verify`) can use it without importing torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


def option(default: Any, help: str) -> Any:
    """A field of an entry's options dataclass: a flag `--field-name` with this default and help text."""
    return dataclasses.field(default=default, metadata={"help": help})


class Registry(Generic[T]):
    def __init__(self, kind: str, builtins: Sequence[str] = ()):
        self.kind = kind
        self.builtins = tuple(builtins)  # modules whose import registers the built-in entries
        self._items: dict[str, T] = {}
        self._options: dict[str, type] = {}
        self._loaded = not self.builtins

    def register(self, name: str, *, options: type | None = None) -> Callable[[T], T]:
        """Decorator: `@registry.register("grpo")`; registering a name twice is an error. `options`: the entry's
        options dataclass (see the module docstring)."""

        def decorate(item: T) -> T:
            self.add(name, item, options=options)
            return item

        return decorate

    def add(self, name: str, item: T, *, options: type | None = None) -> None:
        """Register `item` itself under `name` (what a slot-specific decorator that wraps its function calls)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if options is not None and not dataclasses.is_dataclass(options):
            raise TypeError(f"{self.kind} {name!r}: options must be a dataclass of option() fields, got {options!r}")
        self._items[name] = item
        if options is not None:
            self._options[name] = options

    def get(self, name: str) -> T:
        """The item registered as `name`; an unknown name raises ValueError listing the valid ones."""
        self._load_builtins()
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def build(self, name: str, **kwargs: Any) -> Any:
        """A new instance of the entry registered as `name` (a class or a builder), made with `kwargs`."""
        return self.get(name)(**kwargs)  # type: ignore[operator]

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return name in self._items

    def options(self) -> dict[str, type]:
        """Each entry's options dataclass, by name, for the entries that declare one."""
        self._load_builtins()
        return dict(sorted(self._options.items()))

    def section(self, name: str) -> str:
        """The config section of entry `name`'s options: "verifier.code", "reward_model.hf_rm", "tool.python"."""
        return f"{self.kind.replace(' ', '_')}.{name}"

    def kwargs(self, cfg: Any) -> dict[str, dict[str, Any]]:
        """The keyword arguments each entry that declares options is built with, by name, from a run's config
        (`megarl.config.Config`): its options' `kwargs(cfg)` when it defines one, else its fields. A section absent
        from `cfg.components` (a config built without components) takes its defaults."""
        out = {}
        for name, cls in self.options().items():
            values = cfg.components.get(self.section(name)) or cls()
            kwargs = getattr(values, "kwargs", None)
            out[name] = kwargs(cfg) if callable(kwargs) else dataclasses.asdict(values)
        return out

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # before importing: a built-in module registers into this registry as it loads
        for module in self.builtins:
            importlib.import_module(module)


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
                # The one sys.path edit outside the tests: the user asked for this file to be imported (here and in
                # every reward worker), and its directory is where its own imports live.
                sys.path.insert(0, str(path.parent))
            name = path.stem
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a plugin's own error, whatever it is, stops the run here with its name
            raise ValueError(f"--plugins {item}: importing {name!r} failed: {type(e).__name__}: {e}") from None
        names.append(name)
    return tuple(names)
