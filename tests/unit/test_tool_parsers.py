"""Tool-call parsers (`megarl.tool_calls.parsers`): the calls of a turn in order, malformed calls as `ParseError`s, and
no exception escaping whatever the text (hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.tool_calls import ParseError, ToolCall, TOOL_PARSERS


def test_hermes_reads_calls_in_order_and_malformed_ones_as_errors():
    text = ('I will compute. <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call> then '
            '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": 1</tool_call>'
            '<tool_call>["python"]</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": [1]}</tool_call><tool_call>{"name": "p"')
    calls = TOOL_PARSERS.build("hermes").parse(text)
    assert calls[:2] == [ToolCall("python", {"code": "print(1)"}), ToolCall("search", {"q": "x"})]
    assert [type(c) for c in calls[2:]] == [ParseError] * 5
    messages = [c.message for c in calls[2:]]
    assert messages[0].startswith("tool call is not valid JSON")
    assert messages[1:] == ['tool call must be a JSON object with "name" and "arguments", got list',
                            'tool call has no "name" string',
                            "tool call 'python': \"arguments\" must be a JSON object, got list",
                            "<tool_call> without </tool_call>"]
    assert TOOL_PARSERS.build("hermes").parse("no call here") == []
    assert TOOL_PARSERS.build("hermes").stop == ("</tool_call>",)


def test_hermes_refuses_what_json_cannot_hold_without_raising():
    deep = "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"
    (err,) = TOOL_PARSERS.build("hermes").parse(deep)
    assert isinstance(err, ParseError) and "longer than" in err.message
    nested = "<tool_call>" + "[" * 20_000 + "</tool_call>"
    (err,) = TOOL_PARSERS.build("hermes").parse(nested)
    assert isinstance(err, ParseError) and err.message.startswith("tool call is not valid JSON")


def test_python_blocks_are_calls_of_the_python_tool():
    text = "Let me check.\n```python\nx = 12*34\nprint(x)\n```\nand\n```py\n1+1\n```\n```\nnot code\n```\n```python\n2"
    calls = TOOL_PARSERS.build("python").parse(text)
    assert calls == [ToolCall("python", {"code": "x = 12*34\nprint(x)\n"}), ToolCall("python", {"code": "1+1\n"}),
                     ParseError("```python block without a closing ```")]
    assert TOOL_PARSERS.build("python").parse("408") == []
    p = TOOL_PARSERS.build("python")
    assert p.wrap("408") == "```output\n408\n```\n"
    assert not any(s in "```python\n" for s in p.stop), "the opening fence must not end a turn"
    assert any(s in "```python\n1\n```\n" for s in p.stop)


_FRAGMENTS = ["<tool_call>", "</tool_call>", "```python\n", "```py\n", "```", "\n", "{", "}", '"name"', '"arguments"',
              ":", ",", '"python"', '"code"', "[", "]", "\\", '"', "null", "1e999", "\x00", "\ud800"]


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=8)), max_size=40))
def test_no_exception_escapes_any_parser(pieces):
    text = "".join(pieces)
    for name in TOOL_PARSERS.names():
        calls = TOOL_PARSERS.build(name).parse(text)
        assert isinstance(calls, list) and all(isinstance(c, (ToolCall, ParseError)) for c in calls)
        for c in calls:
            if isinstance(c, ToolCall):
                assert isinstance(c.name, str) and c.name and isinstance(c.arguments, dict)
            else:
                assert isinstance(c.message, str) and c.message


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3),
                     max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=12).filter(lambda s: "</tool_call>" not in s),
       st.dictionaries(st.text(max_size=6), _JSON, max_size=4), st.text(max_size=20))
def test_hermes_reads_back_what_was_written(name, arguments, prose):
    """A call written the way Qwen's template writes it reads back as the same call, wherever it sits."""
    body = json.dumps({"name": name, "arguments": arguments})
    if "</tool_call>" in body or "<tool_call>" in prose:
        return
    text = f"{prose}<tool_call>\n{body}\n</tool_call>"
    assert TOOL_PARSERS.build("hermes").parse(text) == [ToolCall(name, arguments)]


@pytest.mark.parametrize("name", TOOL_PARSERS.names())
def test_parser_contract(name):
    """Every registered parser: a name, stop strings that are strings, `wrap` keeps the output it is given."""
    p = TOOL_PARSERS.build(name)
    assert p.name == name and isinstance(p.stop, tuple) and all(isinstance(s, str) and s for s in p.stop)
    assert "tool says 408" in p.wrap("tool says 408")
    assert p.parse("") == []
