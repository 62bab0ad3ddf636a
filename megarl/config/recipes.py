"""Recipes and the front door of the command line: `[recipe.sh | config.json] [--flag value ...]` -> `Config`.

A recipe is a bash file that fills arrays named `*_ARGS` (`MODEL_ARGS`, `ROLLOUT_ARGS`, ...); bash itself sources
it, so comments, variables and `source recipes/models/<m>.sh` work. Flags after the recipe on the command line
override it. A run's saved `config.json` may stand where a recipe does (`megarl.config.saved`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from megarl.config.flags import build_config, flag_specs, parse_flags
from megarl.config.saved import load_saved, saved_values
from megarl.config.schema import Config
from megarl.errors import ConfigError

ARRAY_ORDER = ("MODEL_ARGS", "ROLLOUT_ARGS", "TOOL_ARGS", "DATA_ARGS", "REWARD_ARGS", "ALGORITHM_ARGS", "TRAINING_ARGS",
               "CHECKPOINT_ARGS", "LOGGING_ARGS", "EVAL_ARGS", "PLUGIN_ARGS")

_DUMP = r"""
set -e
source "$1" >&2
order=(%s)
declare -A seen
for a in "${order[@]}" $(compgen -A arrayvar | sort); do
  [[ $a == *_ARGS ]] || continue
  [[ -n ${seen[$a]:-} ]] && continue
  seen[$a]=1
  declare -n arr=$a
  [[ $(declare -p $a 2>/dev/null) == "declare -a"* ]] || continue
  for x in "${arr[@]}"; do printf '%%s\0' "$x"; done
  unset -n arr
done
""" % " ".join(ARRAY_ORDER)


def read_recipe(path: str | os.PathLike) -> list[str]:
    """The flags a recipe defines, in array order. bash sources the file from the current directory; recipes
    find their siblings through `${BASH_SOURCE[0]}`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe {path}: no such file")
    proc = subprocess.run(["bash", "-c", _DUMP, "megarl-recipe", str(p.resolve())], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        raise ConfigError(f"recipe {path}: bash failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return [t for t in proc.stdout.split("\0") if t != ""]


Sources = tuple[list[tuple[list[str], str]], "dict[str, Any] | None", str]


def recipe_flags(argv: list[str]) -> Sources:
    """The flag tokens of `[recipe.sh | config.json] [--flag value ...]`, as (tokens, where) in the order they
    apply, and a saved config's sections when the first argument is one (with its path): the recipe is read (by
    bash) once, here."""
    rest = list(argv)
    if rest and not rest[0].startswith("--"):
        source = rest.pop(0)
        if source.endswith(".json"):
            return [(rest, "command line")], load_saved(source), source
        return [(read_recipe(source), f"recipe {source}"), (rest, "command line")], None, ""
    return [(rest, "command line")], None, ""


def parse_config(argv: list[str] | Sources, components: dict[str, type] | None = None) -> Config:
    """`[recipe.sh | config.json] [--flag value ...]` -> Config, with the flags of megarl's sections and of
    `components` (section -> options dataclass). The first argument may be a recipe or a run's saved
    `config.json` (`saved_config`), which gives back that run's settings. Raises ConfigError naming the problem.
    Registry names are not checked here: the trainer's command line is `megarl.arguments.parse_args`, which
    imports `--plugins`, adds every component's options and checks the names. `argv` may be `recipe_flags(argv)`
    already read."""
    specs = flag_specs(components)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    pieces, saved, saved_path = argv if isinstance(argv, tuple) else recipe_flags(argv)
    if saved is not None:
        values = saved_values(saved, saved_path, specs, origins)
    for tokens, where in pieces:
        values = parse_flags(tokens, where, values, origins, specs)
    cfg = build_config(values, components)
    cfg.origins = origins
    return cfg
