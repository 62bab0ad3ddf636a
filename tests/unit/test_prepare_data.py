"""megarl-prepare-data (`megarl.cli.prepare_data`) on small files in each public dataset's layout, written here."""

from __future__ import annotations

import gzip
import json

import pytest

from megarl.cli.prepare_data import LAYOUTS, convert, last_boxed, main


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def write_parquet(path, items):
    pa = pytest.importorskip("pyarrow", reason="parquet input needs pyarrow (in the dev extra)")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(items), path)
    return path


def test_gsm8k(tmp_path):
    src = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Tom has 1,000 apples and buys 200 more. How many?", "answer": "1000+200=1200\n#### 1,200"},
        {"question": "No final line", "answer": "42"}])
    counts = convert("gsm8k", src, tmp_path / "out.jsonl")
    assert counts == {"written": 1, "skipped: answer has no '####' line": 1}
    [row] = rows(tmp_path / "out.jsonl")
    assert row["answer"] == "1200" and row["verifier"] == "math" and row["source"] == "gsm8k:0"
    assert row["prompt"].startswith("Tom has") and "\\boxed{}" in row["prompt"]


def test_math_from_parquet_takes_the_last_boxed_answer(tmp_path):
    src = write_parquet(tmp_path / "math.parquet", [
        {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "solution": "First \\boxed{0}? No: \\boxed{\\frac{2}{2}=1}",
         "answer": None},  # pyarrow takes the columns from the first row
        {"problem": "AIME style", "solution": None, "answer": "204"},
        {"problem": "Unanswered", "solution": "we stop here", "answer": None}])
    counts = convert("math", src, tmp_path / "out.jsonl", template="Q: {problem}")
    assert counts["written"] == 2 and counts["skipped: no answer and no \\boxed{} in the solution"] == 1
    a, b = rows(tmp_path / "out.jsonl")
    assert a["answer"] == "\\frac{2}{2}=1" and a["prompt"] == "Q: Compute $\\frac{1}{2}+\\frac{1}{2}$."
    assert b["answer"] == "204"


def test_last_boxed_balances_braces():
    assert last_boxed("x \\boxed{\\sqrt{\\frac{a}{b}}} y") == "\\sqrt{\\frac{a}{b}}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("none") is None and last_boxed("\\boxed{open") is None


def test_dapo_math_chat_prompt_and_ground_truth(tmp_path):
    src = write_parquet(tmp_path / "dapo.parquet", [
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve 2+2. Answer: $Answer"}],
         "reward_model": {"ground_truth": "4", "style": "rule-lighteval/MATH_v2"}},
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Broken"}],
         "reward_model": {"ground_truth": "", "style": "rule"}}])
    counts = convert("dapo-math", src, tmp_path / "out.jsonl")
    assert counts["written"] == 1
    [row] = rows(tmp_path / "out.jsonl")
    assert row == {"prompt": "Solve 2+2. Answer: $Answer", "answer": "4", "verifier": "math", "source": "dapo-math:0"}


def test_code_contests_merges_test_sets_into_stdio_cases(tmp_path):
    t = lambda i, o: {"input": i, "output": o}
    src = write_parquet(tmp_path / "cc.parquet", [
        {"name": "sum", "description": "Read a and b, print a+b.", "public_tests": t(["1 2\n"], ["3\n"]),
         "private_tests": t(["5 5\n"], ["10\n"]), "generated_tests": t(["0 0\n", "9 1\n"], ["0\n", "10\n"])},
        {"name": "untested", "description": "No tests at all", "public_tests": t([], []),
         "private_tests": t([], []), "generated_tests": t([], [])}])
    counts = convert("code-contests", src, tmp_path / "out.jsonl", max_tests=3)
    assert counts == {"written": 1, "skipped: no tests": 1}
    [row] = rows(tmp_path / "out.jsonl")
    assert row["verifier"] == "code" and "standard input" in row["prompt"]
    assert row["answer"] == {"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]}


def test_apps_stdio_and_call_based(tmp_path):
    src = write_jsonl(tmp_path / "apps.jsonl", [
        {"question": "Echo the line.", "input_output": json.dumps({"inputs": ["hi\n"], "outputs": ["hi\n"]})},
        {"question": "Add two numbers.", "input_output": json.dumps({"inputs": [[1, 2]], "outputs": [3],
                                                                     "fn_name": "add"})},
        {"question": "Bad", "input_output": "{not json"}])
    counts = convert("apps", src, tmp_path / "out.jsonl")
    assert counts == {"written": 2, "skipped: input_output is not JSON": 1}
    stdio, call = rows(tmp_path / "out.jsonl")
    assert stdio["answer"] == {"inputs": ["hi\n"], "outputs": ["hi\n"]}
    assert call["answer"] == {"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"} and "`add`" in call["prompt"]


def test_humaneval_gz_gives_function_style_gold(tmp_path):
    src = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(src, "wt") as fh:
        fh.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n",
                             "entry_point": "inc", "test": "def check(candidate):\n    assert candidate(1) == 2\n",
                             "canonical_solution": "    return x + 1\n"}) + "\n")
    assert convert("humaneval", src, tmp_path / "out.jsonl")["written"] == 1
    [row] = rows(tmp_path / "out.jsonl")
    assert row["answer"] == {"prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n", "entry_point": "inc",
                             "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    assert "```python\ndef inc(x):" in row["prompt"] and row["verifier"] == "code"


def test_output_reads_back_through_megarl_loader_and_cli_limit(tmp_path, capsys):
    from megarl.data import load_prompts

    src = write_jsonl(tmp_path / "g.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)])
    assert main(["gsm8k", str(src), str(tmp_path / "out.jsonl"), "--limit", "3"]) == 0
    assert "3 rows written" in capsys.readouterr().err

    class Chars:
        def encode(self, text):
            return [ord(c) % 96 for c in text]

    # The rows' own verifier is "math"; the loader's field checks are what is tested here.
    recs = load_prompts(str(tmp_path / "out.jsonl"), Chars(), input_key="prompt", label_key="answer",
                        verifier_key="no-such-field", default_verifier="arithmetic")
    assert [r.label for r in recs] == ["0", "1", "2"]


def _verifier(name):
    from megarl.verifiers import VERIFIERS

    if name not in VERIFIERS.names():
        pytest.skip(f"no {name!r} verifier registered in this checkout")
    return VERIFIERS.build(name)


def test_converted_code_rows_are_what_the_code_verifier_grades(tmp_path):
    """The gold layouts written here are the ones megarl's `code` verifier runs: a right program passes, a wrong
    one does not, for stdin/stdout, call-based and check(candidate) rows."""
    code = _verifier("code")
    cc = write_jsonl(tmp_path / "cc.jsonl", [{"description": "Print a+b.", "public_tests": {"input": ["1 2\n"],
                                                                                          "output": ["3\n"]}}])
    apps_src = write_jsonl(tmp_path / "apps.jsonl", [{"question": "Add.", "input_output": json.dumps(
        {"inputs": [[1, 2], [5, 5]], "outputs": [3, 10], "fn_name": "add"})}])
    he = write_jsonl(tmp_path / "he.jsonl", [{"prompt": "def inc(x):\n", "entry_point": "inc",
                                               "test": "def check(candidate):\n    assert candidate(1) == 2\n"}])
    cases = [("code-contests", cc, "a, b = map(int, input().split())\nprint(a + b)", "print(0)"),
             ("apps", apps_src, "def add(a, b):\n    return a + b", "def add(a, b):\n    return a"),
             ("humaneval", he, "def inc(x):\n    return x + 1", "def inc(x):\n    return x")]
    for layout, src, right, wrong in cases:
        convert(layout, src, tmp_path / f"{layout}.out.jsonl")
        [row] = rows(tmp_path / f"{layout}.out.jsonl")
        assert code.verify(f"```python\n{right}\n```", row["answer"]).score == 1.0, layout
        assert code.verify(f"```python\n{wrong}\n```", row["answer"]).score == 0.0, layout


def test_converted_math_rows_are_what_the_math_verifier_grades(tmp_path):
    math = _verifier("math")
    src = write_jsonl(tmp_path / "g.jsonl", [{"question": "1,000 + 200?", "answer": "#### 1,200"}])
    convert("gsm8k", src, tmp_path / "out.jsonl")
    [row] = rows(tmp_path / "out.jsonl")
    assert math.verify("So the total is \\boxed{1200}.", row["answer"]).score == 1.0
    assert math.verify("So the total is \\boxed{1100}.", row["answer"]).score == 0.0


def test_help_shows_every_layout_and_bad_input_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(f"  {layout} " in text for layout in LAYOUTS) and "nothing is guessed" in text
    out = tmp_path / "out.jsonl"
    assert main(["gsm8k", str(tmp_path / "missing.parquet"), str(out)]) == 2
    assert "missing.parquet: no such file" in capsys.readouterr().err
    (tmp_path / "bad.parquet").write_text("not parquet")
    assert main(["gsm8k", str(tmp_path / "bad.parquet"), str(out)]) == 2
    assert "bad.parquet: not a readable parquet file" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    assert main(["gsm8k", str(tmp_path / "bad.jsonl"), str(out)]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert list(tmp_path.glob("out.jsonl*")) == [], "a failed conversion leaves no file behind"
