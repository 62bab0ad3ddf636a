"""Flags: each field of a config section, or of a component's options, is `--field-name`; its value is parsed to
the field's type, checked against a `Literal`'s choices, and reported with where it came from. `help_text` is
`--help`, every flag under its section, a component's under the component's name.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, Literal

from megarl.config.schema import SECTIONS, Config
from megarl.errors import ConfigError


@dataclass(frozen=True)
class FlagSpec:
    section: str
    name: str  # dataclass field
    type: Any
    help: str
    names: str = ""  # for a field naming a registry entry: the `module:attribute` listing the valid names
    default: Any = None
    many: bool = False  # a comma-separated list of such names

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def flag_specs(components: dict[str, type] | None = None) -> dict[str, FlagSpec]:
    """Every flag: megarl's sections', then the `components`' (section name -> options dataclass). A field name
    declared twice is an error naming both sections."""
    out: dict[str, FlagSpec] = {}
    for section, cls in {**SECTIONS, **(components or {})}.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = FlagSpec(section, f.name, hints[f.name], f.metadata.get("help", ""), f.metadata.get("names", ""),
                            f.default, f.metadata.get("many", False))
            if spec.flag in out:
                raise ConfigError(f"{spec.flag} is declared twice: by {out[spec.flag].section} and by {section} "
                                  "(each option needs a name of its own)")
            out[spec.flag] = spec
    return out


def convert_value(spec: FlagSpec, raw: str, where: str):
    """`raw`, the text of a flag's value, as the flag's type; ConfigError naming `where` and the flag otherwise."""
    t = spec.type
    if typing.get_origin(t) is Literal:
        choices = typing.get_args(t)
        if raw not in choices:
            raise ConfigError(f"{where}: {spec.flag} {raw!r} is not valid; choose one of: {', '.join(choices)}")
        return raw
    if t is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: {spec.flag} expects true/false, got {raw!r}")
    try:
        return t(raw)
    except ValueError:
        raise ConfigError(f"{where}: {spec.flag} expects {t.__name__}, got {raw!r}") from None


def parse_flags(tokens: list[str], where: str, values: dict[str, Any] | None = None,
                origins: dict[str, str] | None = None, specs: dict[str, FlagSpec] | None = None) -> dict[str, Any]:
    """Apply `--flag value` / `--flag=value` / `--bool-flag` / `--no-bool-flag` tokens onto `values`; `origins`
    (when given) records where each value came from. `specs`: the flags known (default: megarl's own)."""
    specs = specs if specs is not None else flag_specs()
    values = dict(values or {})
    origins = origins if origins is not None else {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise ConfigError(f"{where}: expected a --flag, got {tok!r}")
        name, eq, inline = tok.partition("=")
        positive = specs.get("--" + name[5:]) if name.startswith("--no-") and name not in specs else None
        negated = positive is not None and positive.type is bool
        spec = positive if negated else specs.get(name)
        if negated and eq:
            raise ConfigError(f"{where}: {name} takes no value (use --{name[5:]}={inline} instead)")
        if spec is None:
            close = difflib.get_close_matches(name, specs, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; run with --help for the list"
            raise ConfigError(f"{where}: unknown flag {name}{hint}")
        if spec.type is bool and not eq:
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if nxt is not None and nxt.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off") and not negated:
                values[spec.name], origins[spec.name] = convert_value(spec, nxt, where), where
                i += 2
                continue
            values[spec.name], origins[spec.name] = not negated, where
            i += 1
            continue
        if eq:
            raw = inline
            i += 1
        else:
            if i + 1 >= len(tokens):
                raise ConfigError(f"{where}: {name} needs a value")
            raw = tokens[i + 1]
            i += 2
        values[spec.name], origins[spec.name] = convert_value(spec, raw, where), where
    return values


def build_config(values: dict[str, Any], components: dict[str, type] | None = None) -> Config:
    """A Config from flag values by field name (the rest at their defaults); `components`: the options
    dataclasses of registered components, by section."""
    def make(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    known = {f.name for cls in {**SECTIONS, **(components or {})}.values() for f in dataclasses.fields(cls)}
    if unknown := sorted(set(values) - known):
        # a component's option given without its options dataclass would otherwise be dropped in silence
        raise ConfigError(f"settings {', '.join(unknown)} belong to no section given: a registered component's "
                          "option needs its options passed as `components` (megarl.arguments.components())")

    return Config(**{section: make(cls) for section, cls in SECTIONS.items()},
                  components={section: make(cls) for section, cls in (components or {}).items()})


def help_text(components: dict[str, type] | None = None, valid_names=None) -> str:
    """Every flag by section, with its type, default and help; `valid_names(spec)` lists a registry flag's
    choices (`megarl.arguments` passes the registries' names)."""
    lines = ["usage: torchrun --nproc-per-node N megarl/train.py [recipe.sh | run/config.json] [--flag value ...]",
             ""]
    specs = flag_specs(components)
    for section in {**SECTIONS, **(components or {})}:
        lines.append(f"{section}:")
        for spec in specs.values():
            if spec.section == section:
                t = spec.type
                kind = "|".join(typing.get_args(t)) if typing.get_origin(t) is Literal else t.__name__
                if spec.names and valid_names is not None:
                    kind = "|".join(valid_names(spec))
                lines.append(f"  {spec.flag} <{kind}> (default {spec.default!r}): {spec.help}")
    return "\n".join(lines)
