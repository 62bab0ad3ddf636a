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
under the entry's section (`Registry.section`) like megarl's own (`megarl.arguments`); a plugin's options work the
same with no edit to megarl. The dataclass checks its own values in `__post_init__` (raise `ConfigError` naming the
flag) and may define
- `kwargs(self, cfg) -> dict`: the keyword arguments its entry is built with given the whole run config (to read
  shared sections such as `cfg.sandbox`, or to rename fields); without it the entry gets the fields themselves;
- `resolve(self, cfg) -> None`: rules between its values and the rest of the run's config, run once the config is
  built (`megarl.config.Config.__post_init__`), for every declared entry, chosen or not.

Entries whose code imports torch (estimators, losses, corrections, rollout backends) are registered into a registry
that lives, with the built-ins' options, in a pure-Python module (`megarl.algorithms.slots`,
`megarl.rollout.slots`): those declare their options with `declare(name, options)` before the entry exists, so the
command line parses without importing torch (the launch scripts' check on a batch host).

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


def option(default: Any, help: str, names: str = "", many: bool = False) -> Any:
    """A field of an entry's options dataclass: a flag `--field-name` with this default and help text. `names`:
    for a field whose value names a registry entry, the `module:attribute` of that registry (checked once
    `--plugins` are imported); `many`: the value is a comma-separated list of such names."""
    metadata = {"help": help, **({"names": names} if names else {}), **({"many": True} if many else {})}
    return dataclasses.field(default=default, metadata=metadata)


class Registry(Generic[T]):
    def __init__(self, kind: str, builtins: Sequence[str] = (), options_declared_here: bool = False):
        """`options_declared_here`: the built-ins' options are declared (`declare`) in the module that makes the
        registry, so listing options imports none of `builtins`."""
        self.kind = kind
        self.builtins = tuple(builtins)  # modules whose import registers the built-in entries
        self._declared_here = options_declared_here
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
        if options is not None:
            self.declare(name, options)
        self._items[name] = item

    def declare(self, name: str, options: type) -> type:
        """Declare the options of entry `name`, registered now or later (a built-in whose code imports torch is
        registered by its own module; its options are declared beside the registry, in pure Python)."""
        if not dataclasses.is_dataclass(options):
            raise TypeError(f"{self.kind} {name!r}: options must be a dataclass of option() fields, got {options!r}")
        if self._options.get(name, options) is not options:
            raise ValueError(f"{self.kind} {name!r} already declares options: {self._options[name].__name__}")
        self._options[name] = options
        return options

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
        """Each entry's options dataclass, by name, for the entries that declare one (built-ins whose options are
        declared beside the registry are listed without importing their code)."""
        if not self._declared_here:
            self._load_builtins()
        return dict(sorted(self._options.items()))

    def section(self, name: str) -> str:
        """The config section of entry `name`'s options: "verifier.code", "reward_model.hf_rm", "tool.python",
        "off_policy_correction.tis"."""
        return f"{self.kind.replace(' ', '_').replace('-', '_')}.{name}"

    def settings(self, cfg: Any, name: str) -> Any:
        """Entry `name`'s options as the run set them (`cfg.components`), or their defaults (a config built
        without components, or `cfg` None); None for an entry that declares none."""
        cls = self.options().get(name)
        if cls is None:
            return None
        return (cfg.components.get(self.section(name)) if cfg is not None else None) or cls()

    def kwargs_of(self, cfg: Any, name: str) -> dict[str, Any]:
        """The keyword arguments entry `name` is built (or called) with, from a run's config
        (`megarl.config.Config`): its options' `kwargs(cfg)` when it defines one, else its fields; {} for an entry
        that declares no options."""
        values = self.settings(cfg, name)
        if values is None:
            return {}
        kwargs = getattr(values, "kwargs", None)
        return kwargs(cfg) if callable(kwargs) else dataclasses.asdict(values)

    def kwargs(self, cfg: Any) -> dict[str, dict[str, Any]]:
        """`kwargs_of` for every entry that declares options, by name. A section absent from `cfg.components` (a
        config built without components) takes its defaults."""
        return {name: self.kwargs_of(cfg, name) for name in self.options()}

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


def refuse_bare_capabilities(obj: Any, capabilities: type, what: str, forwarded: Sequence[str] = (),
                             hint: str = "") -> None:
    """Optional abilities are declared by deriving from a seam's capabilities class (`EngineCapabilities`,
    `Rollout`, `RewardFunction`, `VerifierCapabilities`) and read as its fields. Before those classes existed (megarl
    0.1.0 and earlier) megarl probed components for the same names as bare attributes; a plugin written that way
    would now lose those abilities in silence, so it is refused, naming the base class to add. `obj`: the component,
    or its class; `forwarded`: names of the seam's protocol that its wrapper reads from the component itself (a
    reward function's `restarts`); `hint`: another way to declare them, for the message."""
    if isinstance(obj, capabilities) or (isinstance(obj, type) and issubclass(obj, capabilities)):
        return
    bare = [name for name in vars(capabilities)
            if not name.startswith("_") and name not in forwarded and name in dir(obj)]
    if bare:
        raise TypeError(f"{what} {getattr(obj, '__qualname__', type(obj).__qualname__)} defines {', '.join(bare)}, "
                        f"which megarl reads only from a class deriving from {capabilities.__module__}."
                        f"{capabilities.__qualname__}: add that class to its bases{hint}")
