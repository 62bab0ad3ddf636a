"""Tool-call parsers: the text of one model turn -> the calls in it, in order.

- `hermes`: Qwen2.5 / Hermes function calling, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
  Qwen's chat template teaches it (verl's and slime's parser read the same form); `arguments` may also be a JSON
  string holding the object, as OpenAI's API sends it. A turn ends at `</tool_call>`.
- `python`: a fenced ```` ```python ```` block is a call of the `python` tool with the block as its code
  (ToRL / ReTool style); the output comes back in a ```` ```output ```` block. A turn ends at the closing fence
  (```` ```\\n ````; a block closed by the end of the turn is read too).

Whatever the text, `parse` returns: a call that cannot be read (JSON that does not parse, a missing name, an
unclosed tag, a call too long to be one) is a `ParseError` whose message the model then sees.
"""

from __future__ import annotations

import json

from megarl.tool_calls import ParseError, ToolCall, register_parser

MAX_CALL_CHARS = 65536  # longer than any call a rollout's token budget allows; JSON this size is not decoded


def _read_json_call(body: str) -> ToolCall | ParseError:
    if len(body) > MAX_CALL_CHARS:
        return ParseError(f"tool call of {len(body)} characters is longer than {MAX_CALL_CHARS}")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting a RecursionError
        return ParseError(f"tool call is not valid JSON ({type(e).__name__}: {str(e)[:120]})")
    if not isinstance(call, dict):
        return ParseError(f"tool call must be a JSON object with \"name\" and \"arguments\", got {type(call).__name__}")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ParseError("tool call has no \"name\" string")
    if isinstance(arguments, str):  # OpenAI's form: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ParseError(f"tool call {name!r}: \"arguments\" is a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return ParseError(f"tool call {name!r}: \"arguments\" must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


@register_parser("hermes")
class HermesParser:
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    stop = (close,)

    def parse(self, text: str) -> list[ToolCall | ParseError]:
        calls: list[ToolCall | ParseError] = []
        pos = 0
        while (start := text.find(self.open, pos)) >= 0:
            end = text.find(self.close, start + len(self.open))
            if end < 0:
                calls.append(ParseError(f"{self.open} without {self.close}"))
                break
            calls.append(_read_json_call(text[start + len(self.open) : end].strip()))
            pos = end + len(self.close)
        return calls

    def wrap(self, output: str) -> str:
        return f"\n<tool_response>\n{output}\n</tool_response>\n"


@register_parser("python")
class PythonBlockParser:
    name = "python"
    fence = "```"
    openings = ("```python\n", "```py\n")
    stop = ("```\n",)  # the closing fence and its newline; the opening "```python\n" never contains it

    def parse(self, text: str) -> list[ToolCall | ParseError]:
        calls: list[ToolCall | ParseError] = []
        pos = 0
        while True:
            found = [(i, o) for o in self.openings if (i := text.find(o, pos)) >= 0]
            if not found:
                return calls
            start, opening = min(found)
            body = start + len(opening)
            end = text.find(self.fence, body)
            if end < 0:
                calls.append(ParseError(f"{opening.strip()} block without a closing {self.fence}"))
                return calls
            code = text[body:end]
            calls.append(ToolCall("python", {"code": code}) if len(code) <= MAX_CALL_CHARS else
                         ParseError(f"code block of {len(code)} characters is longer than {MAX_CALL_CHARS}"))
            pos = end + len(self.fence)

    def wrap(self, output: str) -> str:
        return f"```output\n{output}\n```\n"
