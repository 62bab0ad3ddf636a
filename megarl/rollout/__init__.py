"""Rollout: engines (`base.RolloutEngine`, chosen by name in `backends`), the weight sync into them, and the
registered rollout functions that turn prompts into finished, scored trajectories (`functions`, `tool_use`).

The names below are loaded on first use (PEP 562), so that `megarl.rollout.slots`, the registries and the
built-ins' options, imports without torch (the command line is parsed on hosts that have none)."""

import importlib

_FROM = {
    "megarl.rollout.base": ("Completion", "RolloutEngine", "SamplingParams"),
    "megarl.rollout.functions": ("ROLLOUTS", "RolloutFn", "build_rollout", "register_rollout", "single_turn"),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

__all__ = ["Completion", "ROLLOUTS", "RolloutEngine", "RolloutFn", "SamplingParams", "build_rollout",
           "register_rollout", "single_turn"]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'megarl.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
