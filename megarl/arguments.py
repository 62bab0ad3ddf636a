"""The trainer's command line: megarl's config sections plus the options every registered component declares.

    cfg = parse_args(["recipes/r1_code.sh", "--code-reward", "fraction"])

Steps, each failing with a `ConfigError` that names the flag and where it came from:
1. `--plugins` (from the recipe, the command line or a saved config.json) are imported first, so what they
   register, and the options their entries declare, exist before any flag is read;
2. the flags are parsed against megarl's sections (`megarl.config`) and the components' options: the options
   dataclass of every registered entry that declares one (`Registry.register(name, options=...)`, or
   `Registry.declare` for the built-ins of `megarl.algorithms.slots` and `megarl.rollout.slots`) adds its fields as
   flags, in the section named after the entry ("off_policy_correction.tis"); each section checks its own values,
   and its `resolve(cfg)` its rules against the rest of the run (`megarl.config.Config`);
3. every flag that names a registry entry is checked against the registry, and the rules registry entries declare
   (a backend's requirements, an estimator's needs) run (`check_names`).

`Registry.kwargs_of(cfg, name)` then gives each component the keyword arguments it is built with, the one way these
settings reach estimators, losses, corrections, rollout functions and backends (`Registry.settings`), verifiers and
reward models (in the trainer, in every reward worker, in `megarl-verify`) and tools.

The registries and the built-ins' options are pure Python: without `check_registries` (the launch scripts' check on
a batch host) nothing here imports torch.
"""

from __future__ import annotations

import importlib

from megarl import config
from megarl.config import Config, FlagSpec
from megarl.errors import ConfigError
from megarl.registry import Registry, load_plugins


def component_registries() -> tuple[Registry, ...]:
    """The registries whose entries may declare options, in the order `--help` lists them."""
    from megarl.algorithms.slots import ADVANTAGES, KL_ESTIMATORS, OFF_POLICY_CORRECTIONS, POLICY_LOSSES
    from megarl.reward.models import REWARD_MODELS
    from megarl.rollout.slots import BACKENDS, ROLLOUTS
    from megarl.tool_calls import TOOL_PARSERS, TOOLS
    from megarl.verifiers.base import VERIFIERS

    return (BACKENDS, ROLLOUTS, TOOL_PARSERS, TOOLS, VERIFIERS, REWARD_MODELS, ADVANTAGES, POLICY_LOSSES,
            KL_ESTIMATORS, OFF_POLICY_CORRECTIONS)


def components(registries: tuple[Registry, ...] | None = None) -> dict[str, type]:
    """Every registered component's options dataclass, by section (import `--plugins` first for theirs); of
    `registries` only, when given."""
    return {r.section(name): cls for r in registries or component_registries() for name, cls in r.options().items()}


def _plugins_named(sources: config.Sources) -> str:
    """The value `--plugins` ends up with (a saved config's, then the recipe's, then the command line's), read
    before the other flags, whose meaning may depend on it."""
    pieces, saved, _ = sources
    value = ""
    if saved is not None:
        value = str((saved["config"].get("plugins") or {}).get("plugins", ""))
    spec = config.flag_specs()["--plugins"]
    for tokens, where in pieces:
        for i, tok in enumerate(tokens):
            if tok == "--plugins" and i + 1 < len(tokens):
                value = config.convert_value(spec, tokens[i + 1], where)
            elif tok.startswith("--plugins="):
                value = tok.split("=", 1)[1]
    return value


def import_plugins(spec: str) -> tuple[str, ...]:
    """Import `--plugins` (idempotent); their module names, for worker processes to import in turn."""
    try:
        return load_plugins(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_args(argv: list[str], check_registries: bool = True) -> Config:
    """`[recipe.sh | config.json] [--flag value ...]` -> Config (see the module docstring). Without
    `check_registries` (the launch scripts' pre-flight check on a batch host) `--plugins` are not imported and
    names are not checked: nothing that imports torch is loaded."""
    sources = config.recipe_flags(argv)
    if check_registries:
        import_plugins(_plugins_named(sources))
    cfg = config.parse_config(sources, components())
    if check_registries:
        check_names(cfg, cfg.origins)
    return cfg


def valid_names(spec: FlagSpec) -> list[str]:
    """The registered names a flag that names a registry entry may take."""
    module, _, attr = spec.names.partition(":")
    source = getattr(importlib.import_module(module), attr)
    return list(source.names() if isinstance(source, Registry) else source())


def check_names(cfg: Config, origins: dict[str, str] | None = None) -> None:
    """Every flag that names a registry entry names a registered one (import `--plugins` first), and the rules
    registry entries declare: a backend's requirements, an estimator's needs."""
    from megarl.algorithms.advantages import ADVANTAGES
    from megarl.reward.compose import parse
    from megarl.rollout.backends import BACKENDS

    origins = origins or {}
    sections = cfg.sections()
    for spec in config.flag_specs(components()).values():
        value = getattr(sections[spec.section], spec.name)
        if not spec.names or value == "":
            continue
        names = [n.strip() for n in value.split(",") if n.strip()] if spec.many else [value]
        if spec.name == "default_verifier":  # a verifier, a reward model or a composition of them
            try:
                names = [p.name for p in parse(value).parts]
            except ValueError as e:
                raise ConfigError(f"{origins.get(spec.name, 'default')}: {spec.flag}: {e}") from None
        valid = valid_names(spec)
        if unknown := [n for n in names if n not in valid]:
            raise ConfigError(f"{origins.get(spec.name, 'default')}: {spec.flag} {unknown[0]!r} is not registered; "
                              f"choose one of: {', '.join(valid)} (--plugins imports modules that register more)")
    BACKENDS.get(cfg.rollout.rollout_backend).check(cfg)
    if ADVANTAGES.get(cfg.algorithm.advantage_estimator).needs.critic and cfg.model.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size > 1 is not supported with --advantage-estimator "
                          f"{cfg.algorithm.advantage_estimator}: its critic is built without context parallelism")


def help_text(argv: list[str] = ()) -> str:
    """`--help`: every flag, the components' included (those of `--plugins` named in `argv` too)."""
    import_plugins(_plugins_named(config.recipe_flags([a for a in argv if a not in ("-h", "--help")])))
    return config.help_text(components(), valid_names)
