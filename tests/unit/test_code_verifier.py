"""The code verifier: extraction, both gold layouts, reward modes, reward hacks, HumanEval (local backend)."""

import json
import time

import pytest

from megarl.sandbox.harness_protocol import parse_verdict
from megarl.verifiers import VERIFIERS
from megarl.verifiers.code import CodeVerifier, extract_code, parse_gold
from sandbox_cases import (KEY_HUNT_FUNCTION, KEY_HUNT_IO, SECRET_ADD, SECRET_IO, humaneval_hacks,
                           humaneval_problems)

ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}


@pytest.fixture(scope="module", params=["persistent harness", "harness as a job"])
def verifier(request):
    """Both ways the local backend runs the trusted harness: its workers' persistent one (the default where
    there is a pid namespace) and one sandbox job per response (the Docker backend's way)."""
    return CodeVerifier(workers=2, time_s=2.0, persistent_harness=request.param == "persistent harness")


def test_registered_and_built_without_arguments():
    v = VERIFIERS.build("code")
    assert v.name == "code" and v.reward == "all"


def test_extract_code():
    assert extract_code("x = 1") == "x = 1"
    text = "Plan:\n```\nnot this\n```\nthen\n```python\nfirst\n```\n```py\nsecond\n```\n"
    assert extract_code(text) == "second\n"
    assert extract_code(text, "first") == "first\n"
    assert extract_code("```\nonly\n```") == "only\n"
    assert extract_code(text, "none") == text


def test_gold_layouts_and_errors():
    spec, n = parse_gold(json.dumps(ADD), 5.0, False)
    assert spec["mode"] == "function" and n == 1
    spec, n = parse_gold({"test": "assert f(1) == 1\nassert f(2) == 2", "time_s": 1}, 5.0, False)
    assert n == 2 and spec["time_s"] == 1.0
    spec, n = parse_gold({"inputs": ["1\n"], "outputs": ["1\n"], "memory_mb": 64}, 5.0, True)
    assert spec["mode"] == "io" and spec["memory_mb"] == 64 and spec["early_stop"]
    assert parse_gold({"inputs": [[1]], "outputs": [[1]], "fn_name": "f"}, 5.0, False)[0]["mode"] == "call"
    with pytest.raises(ValueError, match="test"):
        parse_gold({"answer": 1}, 5.0, False)
    with pytest.raises(ValueError, match="2 inputs for 1 outputs"):
        parse_gold({"inputs": ["a", "b"], "outputs": ["a"]}, 5.0, False)
    with pytest.raises(ValueError, match="entry_point"):
        parse_gold({"test": "def check(candidate):\n    pass\n"}, 5.0, False)


def test_verdict_needs_this_runs_secret():
    line = '@@megarl-code-done s3cret {"results": [{"ok": true}]}'
    assert parse_verdict("noise\n" + line + "\n", "s3cret") == {"results": [{"ok": True}]}
    assert parse_verdict(line, "other") is None


@pytest.mark.slow
def test_function_style(verifier):
    r = verifier.verify("```python\ndef add(a, b):\n    return a + b\n```", ADD)
    assert (r.score, r.outcome, r.normalized) == (1.0, "correct", "1/1 tests passed")
    r = verifier.verify("def add(a, b):\n    return a - b\n", ADD)
    assert (r.score, r.outcome) == (0.0, "incorrect")
    assert verifier.verify("def add(a, b) return", ADD).outcome == "parse_error"
    assert verifier.verify("   ", ADD).outcome == "no_answer"
    assert verifier.verify("def add(a, b):\n    while True:\n        pass\n", ADD).outcome == "timeout"


def test_helpers_of_the_prompt_come_from_the_program(verifier):
    gold = {"test": "def check(candidate):\n    assert helper(candidate(3)) == 8\n", "entry_point": "f"}
    assert verifier.verify("def helper(x):\n    return x * 2\n\ndef f(x):\n    return x + 1\n", gold).score == 1.0


def test_asserts_style_and_reward_modes():
    gold = {"test": "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 1\n"}
    program = "def add(a, b):\n    return a + b\n"
    assert CodeVerifier(workers=1).verify(program, gold).score == 0.0
    r = CodeVerifier(workers=1, reward="fraction").verify(program, gold)
    assert r.score == pytest.approx(2 / 3) and r.outcome == "incorrect"


def _burn(n):
    total = 0
    for i in range(n):
        total += i
    return total


def test_cost_fields_count_tests_and_sandbox_cpu(verifier):
    """`tests_run` is the number of tests the harness ran (asserts, `check`s, stdin/stdout cases; not the ones
    early stop skipped); `sandbox_cpu_seconds` covers the program's own work: a program that burns a known
    amount of CPU per call (measured here, in this process, as the reference) is charged at least half of it."""
    n = 500_000
    start = time.process_time()
    _burn(n)
    per_call = time.process_time() - start
    gold = {"test": "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 1\n"}
    burner = f"def add(a, b):\n    total = 0\n    for i in range({n}):\n        total += i\n    return a + b\n"
    r = verifier.verify(burner, gold)
    assert r.normalized.startswith("2/3") and r.tests_run == 3
    assert 0.5 * 3 * per_call < r.sandbox_cpu_seconds < 3 * per_call + 5.0, (r.sandbox_cpu_seconds, per_call)
    r = verifier.verify("def add(a, b):\n    return a + b\n", ADD)
    assert r.tests_run == 1 and 0 < r.sandbox_cpu_seconds < 2.0
    io = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    r = CodeVerifier(workers=1, early_stop=True).verify("print(7)", io)
    assert r.tests_run == 1 and r.sandbox_cpu_seconds > 0  # the two after the first failure are skipped
    r = verifier.verify("   ", ADD)
    assert r.tests_run is None and r.sandbox_cpu_seconds is None  # nothing ran


def test_stdin_stdout_style(verifier):
    gold = {"inputs": ["1 2\n", "3 4\n", "10 -10\n"], "outputs": ["3\n", "7", "0  \n\n"]}
    r = verifier.verify("a, b = map(int, input().split())\nprint(a + b)\n", gold)
    assert (r.score, r.normalized) == (1.0, "3/3 tests passed")
    r = CodeVerifier(workers=1, reward="fraction").verify("print(3)", gold)
    assert r.score == pytest.approx(1 / 3)
    r = CodeVerifier(workers=1, reward="fraction", early_stop=True).verify("print(7)", gold)
    assert r.score == 0.0 and "wrong_answer" in r.normalized
    slow = {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"], "time_s": 0.5}  # (of CPU time: rpc.Limit)
    busy = "import time\nx = input()\nend = time.process_time() + int(x) - 1\nwhile time.process_time() < end:\n" \
           "    pass\nprint(x)\n"
    r = verifier.verify(busy, slow)
    assert r.normalized.startswith("1/2") and r.outcome == "timeout"
    r = verifier.verify("import time\nx = input()\ntime.sleep(3 * (int(x) - 1))\nprint(x)\n", slow)
    assert r.normalized.startswith("1/2") and r.outcome == "timeout"  # asleep: cut off at 5x the limit of wall time


def test_call_style(verifier):
    gold = {"inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]], "fn_name": "add"}
    assert verifier.verify("def add(a, b):\n    return a + b\n", gold).score == 1.0
    assert verifier.verify("class Solution:\n    def add(self, a, b):\n        return a + b\n", gold).score == 1.0
    assert verifier.verify("def add(a, b):\n    return (a + b, )\n", gold).score == 1.0  # tuple == one-element list


HACKS = {
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n",
    "SystemExit inside the call": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit(0) inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "atexit forcing exit 0": "import atexit, os\natexit.register(lambda: os._exit(0))\n"
                             "def add(a, b):\n    raise ValueError\n",
    "always-equal object": "class E:\n    def __eq__(self, other):\n        return True\n"
                           "def add(a, b):\n    return E()\n",
    "always-equal int subclass": "class E(int):\n    def __eq__(self, other):\n        return True\n"
                                 "def add(a, b):\n    return E(0)\n",
    "killing the parent": "import os, signal\ndef add(a, b):\n"
                          "    os.kill(os.getppid(), signal.SIGKILL)\n    return 0\n",
    "printing a fake verdict": "print('@@megarl-code-done x {\"results\": [{\"ok\": true}]}')\n"
                               "def add(a, b):\n    return 0\n",
    "detached child holding the pipes": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
                                        "def add(a, b):\n    return 0\n",
    "100 MB of output": "import sys\nsys.stdout.write('x' * (100 << 20))\ndef add(a, b):\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hacks_earn_nothing(verifier, name):
    r = verifier.verify(HACKS[name], ADD)
    assert r.score == 0.0, (name, r)


@pytest.mark.slow
def test_humaneval_subset(verifier):
    """Canonical solutions pass, `return None` and the hack variants fail (the full 164: tools/bench/sandbox.py)."""
    problems = humaneval_problems()[::8]  # 21 problems spread over the set
    gold = [{"test": p["test"], "entry_point": p["entry_point"]} for p in problems]
    good = verifier.verify_many([(p["prompt"] + p["canonical_solution"], g) for p, g in zip(problems, gold)])
    assert [r.outcome for r in good] == ["correct"] * len(problems), [r.normalized for r in good]
    bad = verifier.verify_many([(p["prompt"] + "    return None\n", g) for p, g in zip(problems, gold)])
    assert all(r.score == 0.0 for r in bad)
    hacks = [(program, gold[0]) for program in humaneval_hacks(problems[0])]
    assert all(r.score == 0.0 for r in verifier.verify_many(hacks))


@pytest.mark.distributed
def test_through_the_reward_pool():
    """The pool's helper processes build the verifier from the registry and start their own sandbox."""
    from megarl.reward.pool import RewardPool

    requests = [("code", "def add(a, b):\n    return a + b\n", ADD), ("code", "import sys\nsys.exit(0)\n", ADD),
                ("code", "print(int(input()) * 2)", {"inputs": ["21\n"], "outputs": ["42\n"]})]
    with RewardPool(workers=2, timeout_s=60) as pool:
        results, _ = pool.score(requests)
    assert [r.outcome for r in results] == ["correct", "incorrect", "correct"]


def test_the_hunter_finds_a_key_it_can_reach():
    """Control: in a process holding the tests, the hunters do find the answers."""
    spec = dict(SECRET_IO)  # noqa: F841 - reachable through the frame the hunter walks
    env = {}
    exec(KEY_HUNT_FUNCTION, env)
    held = SECRET_ADD["test"]  # noqa: F841 - reachable through the frame the hunter walks
    assert env["add"](2, 3) == 5 and env["add"](10, 7) == 17


def test_the_tests_cannot_be_read(verifier):
    r = verifier.verify(KEY_HUNT_FUNCTION, SECRET_ADD)
    assert r.score == 0.0, r
    r = verifier.verify(KEY_HUNT_IO, SECRET_IO)
    assert r.score == 0.0, r
