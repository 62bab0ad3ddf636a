"""`megarl-verify`: the summary, per-row output in input order, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, env
from megarl.cli.verify import main

# Rows as training data and samples.jsonl hold them: `answer` is the ground truth, `verifier` names the verifier.
ROWS = [
    {"id": "a", "response": "So $\\boxed{\\frac{1}{2}}$.", "answer": "0.5", "verifier": "math", "correct": True,
     "category": "fraction"},
    {"id": "b", "response": "The answer is $(1, 2)$.", "answer": "[1, 2]", "verifier": "math", "correct": False,
     "category": "interval"},
    {"id": "c", "response": "I give up.", "answer": "3", "verifier": "math", "correct": False, "category": "fraction"},
    {"id": "d", "response": "$\\boxed{x \\ge 5}$", "answer": "5 \\le x", "verifier": "math", "correct": True,
     "category": "interval"},
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
    assert "rows.jsonl:3: missing key 'answer' (keys: id, response); --label-key names the field holding the " \
        "ground truth" in err
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
    code, _, err = run([str(tmp_path / "nope.jsonl"), "--verifier", "nope"], capsys)
    assert code == 2 and "--verifier: unknown verifier 'nope'" in err and "math" in err, "caught before any row"
    lines = [ROWS[0], {**ROWS[1], "verifier": "chess"}, {k: v for k, v in ROWS[2].items() if k != "verifier"}]
    code, out, err = run([write(tmp_path, lines)], capsys)
    assert code == 1 and "1 rows scored" in out
    assert ":2: unknown verifier 'chess'" in err and ":3: no 'verifier' field and no --verifier" in err


def test_custom_keys(tmp_path, capsys):
    data = write(tmp_path, [{"completion": "$\\boxed{4}$", "gold": "4", "ok": True}])
    code, out, err = run([data, "--response-key", "completion", "--gold-key", "gold", "--correct-key", "ok",
                          "--verifier", "math"], capsys)
    assert code == 0 and "accuracy 100.0% on 1 labelled rows" in out


def test_two_spellings_of_one_option_with_different_values_are_refused_naming_both(tmp_path, capsys):
    """A user of the previous version wrote `--gold-key gold` and a newer habit added `--label-key label`: scoring
    against either field in silence would be wrong for one of them."""
    data = write(tmp_path, [{"response": "$\\boxed{4}$", "gold": "4", "label": "5", "verifier": "math"}])
    code, out, err = run([data, "--gold-key", "gold", "--label-key", "label"], capsys)
    assert code == 2 and out == ""
    assert "--gold-key gold and --label-key label set one option to two values" in err
    assert "--gold-key is the older spelling of --label-key" in err
    code, _, err = run([data, "--reward-timeout=5", "--timeout", "7"], capsys)
    assert code == 2 and "--reward-timeout 5 and --timeout 7" in err
    code, out, _ = run([data, "--gold-key", "gold", "--label-key=gold"], capsys)  # one value, two spellings: fine
    assert code == 0 and "1 rows scored" in out


def test_rows_follow_their_own_verifier_and_workers_0_is_in_process(tmp_path, capsys):
    lines = [{"response": "12", "answer": "12", "verifier": "arithmetic"},
             {"response": "The answer is 12.", "answer": "12", "verifier": "arithmetic"},  # not a bare number there
             {"response": "The answer is 12.", "answer": "12", "verifier": "math"},
             {"response": "No idea.", "answer": "12"}]  # --verifier's
    out_path = tmp_path / "scored.jsonl"
    code = main([write(tmp_path, lines), "--verifier", "math", "--workers", "0", "--no-progress", "--output",
                 str(out_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "'arithmetic' (2), 'math' (2)" in out
    scored = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [(r["verifier"], r["outcome"]) for r in scored] == [
        ("arithmetic", "correct"), ("arithmetic", "no_answer"), ("math", "correct"), ("math", "no_answer")]


def test_compare_only_compares_math_rows(tmp_path, capsys):
    pytest.importorskip("math_verify")
    code, _, err = run([write(tmp_path, [{"response": "1", "answer": "1", "verifier": "arithmetic"}]),
                        "--compare", "math-verify"], capsys)
    assert code == 2 and "no row is scored by the math verifier" in err
    code, out, err = run([write(tmp_path, [ROWS[0], {"response": "13", "answer": "12", "verifier": "arithmetic"}]),
                          "--compare", "math-verify"], capsys)
    assert code == 0, err
    assert "disagreements with math-verify: 0 of 1 rows scored by the math verifier" in out


def test_saved_rollouts_are_rescored_with_no_key_flags(tmp_path, capsys):
    """samples.jsonl as the trainer writes it (`rollout_sample_rows`): response, answer and verifier per row."""
    from megarl.data import PromptRecord
    from megarl.metrics import rollout_sample_rows
    from megarl.samples import Sample, SampleStatus

    prompts = [PromptRecord(0, "12+7=", [1], "19", "arithmetic"), PromptRecord(1, "Area?", [1], "\\pi", "math")]
    samples = [Sample(group=i, prompt_index=i, prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0],
                      weight_version=1, status=SampleStatus.COMPLETED, response_text=text, reward=1.0,
                      outcome="correct")
               for i, text in enumerate(["19", "It is $\\boxed{\\pi}$."])]
    rows = rollout_sample_rows(3, samples, prompts, limit=8)
    assert [(r["answer"], r["verifier"]) for r in rows] == [("19", "arithmetic"), ("\\pi", "math")]
    data = write(tmp_path, [json.dumps(r) for r in rows])
    code, out, err = main([data, "--workers", "1", "--no-progress"]), *capsys.readouterr()
    assert code == 0, err
    assert "2 rows scored" in out and f"  {'correct':<14}{2:>7}" in out


def test_compare_with_math_verify(tmp_path, capsys):
    pytest.importorskip("math_verify")
    code, out, err = run([write(tmp_path, ROWS), "--compare", "math-verify"], capsys)
    assert code == 0, err
    assert "math-verify  accuracy" in out and "disagreements with math-verify:" in out and "of 4 rows" in out


def test_console_entry_point_runs_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.verify", write(tmp_path, ROWS[:1]), "--workers", "1"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 rows scored" in proc.stdout


def test_the_command_and_verifiers_import_neither_torch_nor_sympy():
    code = ("import sys, megarl.cli.verify, megarl.verifiers.math, megarl.reward.pool; "
            "from megarl.verifiers import VERIFIERS; VERIFIERS.names(); "
            "print(sorted(m for m in ('torch', 'megatron', 'sympy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # sympy loads in the budget helper only
