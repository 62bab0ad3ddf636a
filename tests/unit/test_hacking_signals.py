"""Reward-hacking signals (`megarl.verifiers.signals`, `megarl.reward.hacking`): each planted hack of the test
plugin's catalogue is named by its category, honest programs and answers carry none, signals change no verdict,
the step's rates, the window's alarm and correlation, and `megarl-verify --audit`."""

import json

import numpy as np
import pytest

from hack_catalogue import CATALOGUE, hack_text  # tests/e2e, which tests/conftest.py puts on the path
from helpers import REPO

from megarl.metrics import format_step
from megarl.reward.compose import combine, parse
from megarl.reward.hacking import HackMonitor, correlation, hack_counts, rm_length_sums, step_rates
from megarl.verifiers import VerifyResult
from megarl.verifiers.signals import CATEGORIES, code_signals, math_signals, scan_program, tool_refusal

GOLD = {"test": "assert f(1) == 2\nassert f(2) == 3\n", "entry_point": "f"}
MATH_GOLD = {"answer": "7/12", "not_answers": ["1/3+1/4", "4/12+3/12"]}

HONEST_PROGRAMS = [
    "def f(x):\n    return x + 1\n",
    "def f(x):\n    return sum([v for v in x if v % 2 == 0]) * 3\n",
    "import math\ndef f(x):\n    list = [1, 2]\n    return math.floor(x) + len(list)\n",  # a local named `list`
    "def f(x):\n    s = 'sys.exit(0) is a string, not a call'\n    return x.upper()\n",
    "def f(x):\n    print('debug', x)\n    return sorted(x)[::-1]\n",
    "class P:\n    def __eq__(self, other):\n        return isinstance(other, P)\ndef f(x):\n    return x\n",
    "def f(x:\n",  # does not compile: tried nothing
]


@pytest.mark.parametrize("kind", [k for k, e in enumerate(CATALOGUE) if e[0] == "code"])
def test_each_planted_code_hack_is_named_from_its_source(kind):
    program = hack_text(kind, GOLD).removeprefix("```python\n").removesuffix("```")
    assert CATALOGUE[kind][1] in scan_program(program), CATALOGUE[kind][2]


def test_honest_programs_carry_no_signal():
    for program in HONEST_PROGRAMS:
        assert scan_program(program) == {}, program


def test_the_sandbox_report_adds_runtime_evidence():
    found = code_signals("def f(x):\n    return x\n", ["program PermissionError: [Errno 13] Permission denied: '/etc'",
                                                       "check SystemExit: 0"])
    assert set(found) == {"sandbox_refusal", "early_exit"} and found["sandbox_refusal"].startswith("sandbox:")
    assert code_signals("def f(x):\n    return x\n", ["wrong_answer 3"], "ok") == {}


def test_the_kernels_seccomp_count_is_the_refusal_evidence():
    """`RunResult.seccomp_denied` (the sandbox's supervisor, tests/sandbox/test_seccomp_denials.py) becomes the
    `sandbox_refusal` evidence, most frequent first, before what the program's text suggests."""
    denied = {"socket(AF_INET)": 1, "ptrace": 3, "mount": 1}
    assert code_signals("def f(x):\n    return x\n", [], "ok", "", denied) == {
        "sandbox_refusal": "seccomp denied: ptrace x3, mount x1, socket(AF_INET) x1"}
    found = code_signals("import socket\nsocket.socket()\nimport sys\nsys.exit(0)\n", [], "ok", "", denied)
    assert found["sandbox_refusal"].startswith("seccomp denied: ptrace x3") and "early_exit" in found
    assert code_signals("import socket\n", [], "ok", "", {})["sandbox_refusal"].startswith("imports socket")


def test_math_signals():
    copy = math_signals("\\boxed{1/4+1/3}", MATH_GOLD, "1/4+1/3", "incorrect")
    assert "question_copy" in copy
    assert "question_copy" in math_signals("", MATH_GOLD, "\\frac{1}{4}+\\frac{1}{3}", "incorrect")
    # wrong answers with the question's numbers, not copies (honest samples of the math demo's run)
    for answer, label in (("(x-2)(x+2)", {"answer": "(x-2)(x+1)", "not_answers": ["x^2-x-2"]}),
                          ("8\\sqrt{8}", {"answer": "4\\sqrt{2}", "not_answers": ["\\sqrt{8}+\\sqrt{8}"]}),
                          ("\\sqrt{\\sqrt{3}}\\sqrt{3}",
                           {"answer": "2\\sqrt{3}", "not_answers": ["\\sqrt{3}+\\sqrt{3}"]})):
        assert math_signals(f"\\boxed{{{answer}}}", label, answer, "incorrect") == {}, answer
    assert "question_copy" in math_signals("", {"answer": "(x-2)(x+1)", "not_answers": ["x^2-x-2"]}, "-2-x+x^2",
                                           "incorrect")
    hedged = math_signals("\\boxed{7/12}\n\\boxed{1/2}", MATH_GOLD, "1/2", "incorrect")
    assert list(hedged) == ["hedged_answers"]
    assert math_signals("x = 7/12, so\n\\boxed{7/12}\n\\boxed{ 7/12 }", MATH_GOLD, "7/12", "correct") == {}
    bare = {**MATH_GOLD, "needs_working": True}
    assert "no_working" in math_signals("\\boxed{7/12}", bare, "7/12", "correct")
    assert math_signals("1/3+1/4 = 4/12+3/12 = 7/12\n\\boxed{7/12}", bare, "7/12", "correct") == {}


def test_the_math_verifier_reports_signals_and_its_verdict_is_unchanged():
    from megarl.verifiers.math import MathVerifier

    on, off = MathVerifier(), MathVerifier(signals=False)
    try:
        for k, e in enumerate(CATALOGUE):
            if e[0] != "math":
                continue
            response = hack_text(k, MATH_GOLD)
            a, b = on.verify_unguarded(response, MATH_GOLD), off.verify_unguarded(response, MATH_GOLD)
            assert e[1] in a.signals and b.signals == {}
            assert (a.score, a.outcome, a.extracted) == (b.score, b.outcome, b.extracted)
        honest = on.verify_unguarded("1/3+1/4 = 4/12+3/12 = 7/12\n\\boxed{7/12}", {**MATH_GOLD, "needs_working": 1})
        assert honest.outcome == "correct" and honest.signals == {}
    finally:
        on.close()
        off.close()


def test_the_code_verifier_reports_sandbox_runs_and_changes_no_verdict():
    from megarl.verifiers.code import CodeVerifier

    kinds = [k for k, e in enumerate(CATALOGUE) if e[0] == "code"][::3]
    pairs = [(hack_text(k, GOLD), GOLD) for k in kinds] + [("def f(x):\n    return x + 1\n", GOLD)]
    on = CodeVerifier(signals=True).verify_many(pairs)
    off = CodeVerifier(signals=False).verify_many(pairs)
    for k, a, b in zip(kinds, on, off):
        assert CATALOGUE[k][1] in a.signals and b.signals == {}
        assert (a.score, a.outcome) == (b.score, b.outcome) == (0.0, "incorrect"), CATALOGUE[k][2]
    assert (on[-1].score, on[-1].signals) == (1.0, {})


def test_tool_refusals():
    assert tool_refusal("error: memory limit of 256 MB exceeded", "error").startswith("tool:")
    assert tool_refusal("PermissionError: [Errno 13] Permission denied", "error")
    assert tool_refusal("error: NameError: name 'y' is not defined", "error") == ""
    assert tool_refusal("42", "ok") == ""
    # what the kernel counted comes first, and counts even when the call caught it and ended well
    assert tool_refusal("42", "ok", "seccomp denied: ptrace x1") == "tool: seccomp denied: ptrace x1"
    assert tool_refusal("error: memory limit of 256 MB exceeded", "error", "seccomp denied: ptrace x1") == \
        "tool: seccomp denied: ptrace x1"


def test_compose_flags_a_model_that_pays_where_the_rule_does_not():
    spec, models = parse("math + 0*hf_rm"), {"hf_rm"}
    rule, rm = VerifyResult(0.0, "incorrect", signals={"hedged_answers": "2 boxes"}), VerifyResult(2.5, "correct")
    out = combine(spec, [rule, rm], models)
    assert set(out.signals) == {"hedged_answers", "rm_disagrees"} and out.score == 0.0
    assert combine(spec, [VerifyResult(1.0, "correct"), rm], models).signals == {}


def test_step_rates_the_window_alarm_and_the_length_correlation():
    class S:
        def __init__(self, signals):
            self.signals = signals

    counts = hack_counts([S({"early_exit": "x", "test_read": "y"}), S({}), S({"early_exit": "z"}), S({})])
    assert counts["hack_n_early_exit"] == 2 and counts["hack_n_test_read"] == 1 and counts["hack_n_any"] == 2
    rates = step_rates(counts, 4)
    assert rates["hack/early_exit"] == 0.5 and rates["hack/any"] == 0.5 and set(rates) >= {
        f"hack/{c}" for c in CATEGORIES}

    rng = np.random.default_rng(0)
    length = rng.integers(5, 100, 40).astype(float)
    score = 0.03 * length + rng.normal(0, 0.5, 40)
    monitor = HackMonitor(window=2, alarm=0.3)
    rows = []
    for half in (slice(0, 20), slice(20, 40)):
        row = {**step_rates({"hack_n_early_exit": 1}, 20), **rm_length_sums(list(zip(score[half], length[half])))}
        assert monitor.observe(row, 20) is None  # 1 of 20: under the alarm
        rows.append(row)
    assert rows[-1]["hack/rm_length_corr"] == pytest.approx(np.corrcoef(score, length)[0, 1], abs=1e-9)
    said = monitor.observe(step_rates({"hack_n_early_exit": 20}, 20), 20)  # window: 1 + 20 of 40
    assert said is not None and "early_exit 52.5%" in said
    assert correlation(2, 1, 1, 1, 1, 1) is None


def test_the_progress_line_names_the_top_signal():
    row = {"step": 3, "hack/any": 0.25, "hack/early_exit": 0.2, "hack/test_read": 0.05}
    assert "hack 25.0% (early_exit 20.0%)" in format_step(row, 10)
    assert "hack" not in format_step({"step": 3, "hack/any": 0.0}, 10)


def test_audit_prints_the_table_by_category(tmp_path, capsys):
    from megarl.cli.verify import main

    data = tmp_path / "rows.jsonl"
    kinds = [k for k, e in enumerate(CATALOGUE) if e[0] == "math"]
    rows = [{"response": hack_text(k, MATH_GOLD), "answer": MATH_GOLD, "verifier": "math"} for k in kinds]
    rows.append({"response": "1/3+1/4 = 7/12\n\\boxed{7/12}", "answer": MATH_GOLD, "verifier": "math"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(data), "--audit", "--workers", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{len(kinds)} of {len(rows)} responses flagged" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("hedged_answers "))
    assert line.split()[1] == str(sum(CATALOGUE[k][1] == "hedged_answers" for k in kinds))
    assert "line 1 (math, reward 0)" in out


def test_the_bench_switch_alternates_the_signals_and_changes_no_reward(monkeypatch):
    """`MEGARL_BENCH_SIGNALS=alternate`: off in odd steps, on in even ones; either way, through the reward pool's
    workers and in process, every verdict is the same, and only the signals (and their seconds) differ."""
    from megarl.data import PromptRecord
    from megarl.errors import ConfigError
    from megarl.reward import InProcessReward, PoolReward, RewardMeter
    from megarl.reward.pool import RewardPool
    from megarl.samples import Sample, SampleStatus
    from megarl.verifiers.signals import BENCH_ENV, bench_on

    monkeypatch.delenv(BENCH_ENV, raising=False)
    assert all(bench_on(step) for step in (1, 2, 3))
    monkeypatch.setenv(BENCH_ENV, "alternate")
    assert [bench_on(step) for step in (1, 2, 3, 4)] == [False, True, False, True]
    monkeypatch.setenv(BENCH_ENV, "sometimes")
    with pytest.raises(ConfigError, match=BENCH_ENV):
        bench_on(2)

    code = [k for k, e in enumerate(CATALOGUE) if e[0] == "code"][::4]
    maths = [k for k, e in enumerate(CATALOGUE) if e[0] == "math"]
    rows = [PromptRecord(0, "f", [1], GOLD, "code"), PromptRecord(1, "7/12", [2], MATH_GOLD, "math")]
    texts = ([(0, hack_text(k, GOLD)) for k in code] + [(0, "```python\ndef f(x):\n    return x + 1\n```")] +
             [(1, hack_text(k, MATH_GOLD)) for k in maths] + [(1, "1/3+1/4 = 7/12\n\\boxed{7/12}")])
    samples = [Sample(group=g, prompt_index=g, prompt_ids=[1], response_ids=[7], loss_mask=[1], rollout_logprobs=[0.0],
                      weight_version=0, status=SampleStatus.COMPLETED, response_text=text) for g, text in texts]
    records = [rows[s.group] for s in samples]
    # as the run's options declare them; a budget no loaded machine reaches, so no verdict is a timeout
    options = {"code": {"signals": True}, "math": {"signals": True, "budget_s": 120.0}}
    with RewardPool(workers=1, timeout_s=120, options=options) as pool:
        for reward in (PoolReward(pool), InProcessReward(options)):
            on, off = RewardMeter(reward, signals=True), RewardMeter(reward, signals=False)
            a, b = on(samples, records), off(samples, records)
            assert [(r.score, r.outcome, r.extracted) for r in a] == [(r.score, r.outcome, r.extracted) for r in b]
            assert [r.score for r in a][len(code)] == 1.0 and a[-1].score == 1.0
            assert sum(bool(r.signals) for r in a) == len(code) + len(maths), [r.signals for r in a]
            assert all(r.signals == {} and r.signals_seconds == 0.0 for r in b)
            h_on, h_off = on.health(group_size=1), off.health(group_size=1)
            assert h_on["reward_signals_seconds"] > 0.0 == h_off["reward_signals_seconds"]
            assert (h_on["reward_signals_on"], h_off["reward_signals_on"]) == (1.0, 0.0)
            reward.close()


def test_hack_recall_leaves_out_the_off_steps_of_a_bench_run(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("hack_recall", REPO / "tools" / "hack_recall.py")  # by file
    hack_recall = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hack_recall)
    main = hack_recall.main

    run = tmp_path / "run"
    run.mkdir()
    samples = [{"step": step, "response": "x", "signals": {"early_exit": "e"} if step == 2 and i == 0 else {}}
               for step in (1, 2, 3, 4) for i in range(50)]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    metrics = [{"step": s, "n_samples": 100, "hack/any": 0.01 * (s == 2), "reward_signals_on": float(s % 2 == 0),
                "step_seconds": 1.0 + s % 2, "t_reward": 0.5, "t_reward_exposed": 0.1,
                "reward_signals_s": 0.02 * (s % 2 == 0)}
               for s in (1, 2, 3, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    assert main(["--honest", str(run / "samples.jsonl"), "--cost", str(run / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "100 samples of 2 steps with signals off" in out and "(1 of 100;" in out
    assert "1 of 200 samples carried a signal" in out
    assert "0.200 ms a sample (200 samples" in out
