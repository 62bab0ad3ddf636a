"""`megarl-verify`: the summary, per-row output in input order, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, env
from megarl.cli.verify import main

ROWS = [
    {"id": "a", "response": "So $\\boxed{\\frac{1}{2}}$.", "gold": "0.5", "label": True, "category": "fraction"},
    {"id": "b", "response": "The answer is $(1, 2)$.", "gold": "[1, 2]", "label": False, "category": "interval"},
    {"id": "c", "response": "I give up.", "gold": "3", "label": False, "category": "fraction"},
    {"id": "d", "response": "$\\boxed{x \\ge 5}$", "gold": "5 \\le x", "label": True, "category": "interval"},
]


def write(tmp_path, lines) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def run(argv, capsys):
    code = main(argv + ["--workers", "1", "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_and_rows_in_input_order(tmp_path, capsys):
    data = write(tmp_path, ROWS)
    out_path = tmp_path / "scored.jsonl"
    code, out, err = run([data, "--output", str(out_path)], capsys)
    assert code == 0, err
    assert "4 rows scored" in out
    assert "accuracy 100.0% on 4 labelled rows" in out and "false positives 0.0%" in out
    assert "fraction" in out and "interval" in out and "latency: p50" in out and "slowest:" in out
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c", "d"]
    assert [r["outcome"] for r in rows] == ["correct", "incorrect", "no_answer", "correct"]
    assert all(isinstance(r["score"], float) and r["seconds"] >= 0 for r in rows)
    assert rows[0]["extracted"] == "\\frac{1}{2}"


def test_bad_lines_are_reported_with_their_number_and_skipped(tmp_path, capsys):
    lines = [ROWS[0], "{not json", {"id": "x", "response": "1"}, "[1, 2]", ROWS[1]]
    out_path = tmp_path / "scored.jsonl"
    code, out, err = run([write(tmp_path, lines), "--output", str(out_path)], capsys)
    assert code == 1
    assert "rows.jsonl:2: not valid JSON" in err
    assert "rows.jsonl:3: missing key 'gold'" in err
    assert "rows.jsonl:4: expected a JSON object, got list" in err
    assert "2 rows scored" in out
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r.get("outcome", "error" if "error" in r else None) for r in rows] == \
        ["correct", "error", "error", "error", "incorrect"]


def test_strict_stops_at_the_first_bad_line(tmp_path, capsys):
    code, out, err = run([write(tmp_path, [ROWS[0], "{not json", ROWS[1]]), "--strict"], capsys)
    assert code == 2 and ":2: not valid JSON" in err and "--strict" in err and "rows scored" not in out


def test_missing_file_and_unknown_verifier(tmp_path, capsys):
    code, _, err = run([str(tmp_path / "nope.jsonl")], capsys)
    assert code == 2 and "nope.jsonl: no such file" in err
    code, _, err = run([write(tmp_path, ROWS), "--verifier", "nope"], capsys)
    assert code == 2 and "unknown verifier 'nope'" in err and "math" in err


def test_custom_keys(tmp_path, capsys):
    data = write(tmp_path, [{"completion": "$\\boxed{4}$", "answer": "4", "ok": True}])
    code, out, err = run([data, "--response-key", "completion", "--gold-key", "answer", "--label-key", "ok"], capsys)
    assert code == 0 and "accuracy 100.0% on 1 labelled rows" in out


def test_compare_with_math_verify(tmp_path, capsys):
    pytest.importorskip("math_verify")
    code, out, err = run([write(tmp_path, ROWS), "--compare", "math-verify"], capsys)
    assert code == 0, err
    assert "math-verify  accuracy" in out and "disagreements with math-verify:" in out


def test_console_entry_point_runs_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.verify", write(tmp_path, ROWS[:1]), "--workers", "1"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 rows scored" in proc.stdout


def test_the_command_and_verifiers_import_neither_torch_nor_sympy():
    code = ("import sys, megarl.cli.verify, megarl.verifiers.math, megarl.verifiers.pool; "
            "from megarl.verifiers import verifier_names; verifier_names(); "
            "print(sorted(m for m in ('torch', 'megatron', 'sympy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # sympy loads in the budget helper only
