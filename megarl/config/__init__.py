"""Typed configuration, recipes, and the command line generated from them, by job:

    megarl.config.schema    the sections (one dataclass per concern) and `Config`, with the rules across them
    megarl.config.flags     flags from the dataclasses: parsing, checking, `--help`
    megarl.config.recipes   bash recipes and the front door: `[recipe.sh | config.json] [--flag value ...]` -> Config
    megarl.config.saved     a run's `config.json`: written, and read back

Besides megarl's sections, a run's config holds the options that registered components declare for themselves (an
estimator's, a correction's, a backend's, a verifier's, a tool's: `megarl.registry`); `megarl.arguments` gathers
them and passes them here as `components`, so this package names none of them. Flags whose values name a registry
entry carry the registry's `module:attribute` in their metadata (`names`); `megarl.arguments` checks them once
`--plugins` are imported. Every problem is reported before any work starts, naming the flag, where it came from, and
the valid values.

Imports no torch: nothing of megarl but its errors and the pure-Python rule modules its checks call
(`megarl.mcore.rules`, `megarl.rollout.slots`). Every name below is importable from `megarl.config`, as before the
split.
"""

from megarl.config.flags import FlagSpec, build_config, convert_value, flag_specs, help_text, parse_flags
from megarl.config.recipes import ARRAY_ORDER, Sources, parse_config, read_recipe, recipe_flags
from megarl.config.saved import SAVED_CONFIG, load_saved, saved_config, saved_values
from megarl.config.schema import (
    SECTIONS,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    PluginConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
    TrainingConfig,
)
from megarl.errors import ConfigError

__all__ = ["ARRAY_ORDER", "SAVED_CONFIG", "SECTIONS", "AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError",
           "DataConfig", "FlagSpec", "LoggingConfig", "ModelConfig", "PluginConfig", "RewardConfig", "RolloutConfig",
           "SandboxConfig", "Sources", "TrainingConfig", "build_config", "convert_value", "flag_specs", "help_text",
           "load_saved", "parse_config", "parse_flags", "read_recipe", "recipe_flags", "saved_config", "saved_values"]


def __getattr__(name: str):
    """`ToolConfig`, the section of the `--tool-*` flags until megarl 0.2, is now the options of the `tool_use`
    rollout function, `megarl.rollout.slots.ToolUseOptions` (the same fields); this name goes in megarl 0.3."""
    if name == "ToolConfig":
        from megarl.rollout.slots import ToolUseOptions

        return ToolUseOptions
    raise AttributeError(f"module 'megarl.config' has no attribute {name!r}")
