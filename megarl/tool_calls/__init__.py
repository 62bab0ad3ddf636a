"""Tool use inside a rollout: how a model's turn is read for tool calls (parsers) and what runs them (tools).

    @register_parser("mine")
    class Mine:                      # finds calls in one turn's text
        name = "mine"
        stop = ("</call>",)          # stop strings that end a turn at a call's end (the engine stops there)
        def parse(self, text) -> list[ToolCall | ParseError]: ...
        def wrap(self, output) -> str: ...   # a tool's output as text, for models without a chat template

    @register_tool("mine")
    def build(settings: ToolSettings) -> Tool: ...   # Tool.run_many(calls) -> one Observation per call

A parser never raises on what a model wrote: a call it cannot read is a `ParseError`, which the rollout turns
into an error observation the model sees. A tool never raises either: a timeout, a crash, a memory bomb or
garbage is an `Observation` with `ok=False`. `megarl.rollout.tool_use` is the rollout function that uses both
(`--rollout-function tool_use`, `--tool-parser`, `--tools`). This package imports neither torch nor megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

from megarl.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    """One call a model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ParseError:
    """Something that looked like a call and could not be read; `message` is what the model is told."""

    message: str


ObservationStatus = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class Observation:
    """What a call gave back: the text the model sees next, how it ended and the seconds it took; `refused`, what
    the tool's sandbox refused the call while it ran (`seccomp denied: socket(AF_INET) x1`), for the reward-hacking
    signals (`tool_refusal`) and never shown to the model."""

    text: str
    status: ObservationStatus = "ok"
    seconds: float = 0.0
    refused: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class ToolSettings:
    """Per-call limits and where the code runs: what `--tool-*` and `--sandbox*` flags give a tool's builder."""

    timeout_s: float = 5.0  # wall clock per call
    memory_mb: int = 256
    output_bytes: int = 4096  # of stdout and of stderr each; more is cut and said so
    sandbox: str = "local"  # megarl.sandbox backend
    workers: int = 2  # sandbox workers: the calls of a batch run this many at a time
    image: str | None = None  # --sandbox docker: the image


class ToolParser(Protocol):
    name: str
    stop: tuple[str, ...]

    def parse(self, text: str) -> list[ToolCall | ParseError]: ...

    def wrap(self, output: str) -> str: ...


class Tool(Protocol):
    name: str

    def run_many(self, calls: Sequence[ToolCall]) -> list[Observation]: ...

    def close(self) -> None: ...


TOOL_PARSERS: Registry[Callable[[], ToolParser]] = Registry("tool parser", builtins=("megarl.tool_calls.parsers",))
# A tool's builder, `(settings: ToolSettings, **options) -> Tool`; `options` are the fields of the options dataclass
# the tool may declare (`register_tool(name, options=...)`, `megarl.registry`).
TOOLS: Registry[Callable[..., Tool]] = Registry("tool", builtins=("megarl.tool_calls.python",))

register_parser = TOOL_PARSERS.register  # a parser class, built with no arguments
register_tool = TOOLS.register


def tool_settings(tc, sb=None) -> ToolSettings:
    """The per-call limits and sandbox the tools of `--rollout-function tool_use` are built with, from its options
    (`megarl.rollout.slots.ToolUseOptions`, `--tool-*`) and the run's `SandboxConfig` (`--sandbox*`; None: the
    default sandbox, as `SandboxConfig()` gives it: local, no image)."""
    return ToolSettings(timeout_s=tc.tool_timeout, memory_mb=tc.tool_memory_mb, output_bytes=tc.tool_output_bytes,
                        sandbox=sb.sandbox if sb else ToolSettings.sandbox, workers=tc.tool_workers,
                        image=(sb.sandbox_image or None) if sb else None)


def build_tool(name: str, settings: ToolSettings | None = None, **options) -> Tool:
    """A new instance of tool `name`, with `settings` (defaults when None) and its own options."""
    return TOOLS.get(name)(settings or ToolSettings(), **options)


__all__ = ["TOOLS", "TOOL_PARSERS", "Observation", "ParseError", "Tool", "ToolCall", "ToolParser", "ToolSettings",
           "build_tool", "register_parser", "register_tool", "tool_settings"]
