"""The tool demo's task and starter rows: the split, a demonstration that is exactly what the python parser and tool
make of the call, and pre-training labels that cover only what the model writes."""

from __future__ import annotations

from megarl.tasks.arithmetic import build_tokenizer
from megarl.tasks.multiplication import CHARS, all_problems, split_problems, tool_call, tool_output
from megarl.tool_calls import ToolCall, TOOL_PARSERS


def test_split_and_answers():
    train, held = split_problems()
    assert (len(train), len(held)) == (900 * 90 - 200, 200) and not {p.id for p in train} & {p.id for p in held}
    assert split_problems()[1] == held  # seeded
    p = all_problems()[0]
    assert (p.prompt, p.answer, p.verifier) == ("100*10=", "1000", "arithmetic")
    assert all(int(q.answer) == int(q.prompt[:-1].split("*")[0]) * int(q.prompt[:-1].split("*")[1])
               for q in held)


def test_a_demonstration_is_what_the_parser_and_tool_make_of_the_call():
    p = all_problems()[12345]
    parser = TOOL_PARSERS.build("python")
    assert parser.parse(tool_call(p)) == [ToolCall("python", {"code": p.prompt[:-1] + "\n"})]
    assert any(tool_call(p).endswith(s) for s in parser.stop)  # the turn ends where the engine stops it
    assert parser.wrap(p.answer) == tool_output(p.answer)


def test_starter_rows_label_only_the_models_tokens():
    from tools.make_tool_starter_model import row

    tok = build_tokenizer(chars=CHARS)
    p = all_problems()[777]
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    ids, labels = row(p, tok, use_tool=True)
    prompt, call, out, answer = enc(p.prompt), enc(tool_call(p)), enc(tool_output(p.answer)), enc(p.answer) + [0]
    assert ids == prompt + call + out + answer
    assert labels == [-100] * len(prompt) + call + [-100] * len(out) + answer
    ids, labels = row(p, tok, use_tool=False)
    assert (ids, labels) == (prompt + answer, [-100] * len(prompt) + answer)
