"""A run's resolved config, saved beside its metrics and in every checkpoint as `config.json`, and read back.

A file saved by an older megarl still loads: each setting is read by its name, whatever section held it then (a
flag that moved from megarl's sections into a component's options keeps its name, so its value lands in the
component's section; tests/assets/saved_configs/ holds files written before the move).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megarl.checkpoint_layout import SAVED_CONFIG  # noqa: F401 - megarl.config.SAVED_CONFIG, from its one home
from megarl.config.flags import FlagSpec, convert_value
from megarl.config.schema import Config
from megarl.errors import ConfigError


def saved_config(cfg: Config, **facts: Any) -> dict[str, Any]:
    """What `config.json` holds: every setting by section, where each non-default one came from, and `facts`
    about the run (command line, world size, the padded vocabulary...)."""
    from megarl import __version__

    return {"megarl_version": __version__, **facts, "config": cfg.to_dict(), "origins": dict(cfg.origins)}


def load_saved(path: str | os.PathLike) -> dict[str, Any]:
    """A saved `config.json`, checked to hold a "config" object; ConfigError naming the file otherwise."""
    where = f"config {path}"
    try:
        saved = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: not a readable JSON file ({e})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise ConfigError(f"{where}: no \"config\" object (a run's saved config.json has one)")
    return saved


def saved_values(saved: dict[str, Any], path: str | os.PathLike, specs: dict[str, FlagSpec],
                 origins: dict[str, str] | None = None) -> dict[str, Any]:
    """The settings of a loaded `config.json` as flag values, each checked as a flag is; `origins` records them.
    A setting saved under another section than today's (a component's option that was one of megarl's reward
    settings) is read by its name: its flag is the same."""
    where = f"config {path}"
    by_name = {s.name: s for s in specs.values()}
    values: dict[str, Any] = {}
    for section, fields in saved["config"].items():
        for name, value in (fields.items() if isinstance(fields, dict) else ()):
            spec = by_name.get(name)
            if spec is None:
                plugin = " or needs the --plugins that declared it" if "." in section else ""
                raise ConfigError(f"{where}: unknown setting {section}.{name} (written by megarl "
                                  f"{saved.get('megarl_version', '?')}; this is a different version{plugin})")
            values[name] = convert_value(spec, value if isinstance(value, str) else json.dumps(value), where)
            if origins is not None:
                origins[name] = where
    return values
