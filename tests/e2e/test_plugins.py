"""`--plugins`: a module outside the package registers a verifier (with an option of its own) and a rollout
function; `train.py` trains with both (the verifier inside the reward pool's workers, built with the option the
recipe sets; the rollout function in the trainer's ranks) and `megarl-verify` scores rows with the verifier (in its
own workers, the option from its command line). The same module registers an advantage estimator, an off-policy
correction and a rollout backend, each with an option of its own: a recipe sets the three, `train.py` trains with
them, and each component records the value it got; `--help` lists each option under its component."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
PLUGIN = "tests/e2e/example_plugin.py"


def _traced(trace: Path, what: str) -> set[int]:
    return {int(p.suffix[1:]) for p in trace.glob(f"{what}.*")}


def _recipe(tmp_path: Path) -> Path:
    """A user's recipe: the demo's, plus the plugin and the plugin verifier's own option."""
    recipe = tmp_path / "with_plugin.sh"
    recipe.write_text(f"source {REPO}/recipes/tiny_cpu.sh\nPLUGIN_ARGS=(--plugins {PLUGIN})\n"
                      "REWARD_ARGS+=(--first-chars 13579)\n")
    return recipe


def test_train_with_a_plugin_verifier_and_rollout_function(starter, tmp_path):
    rows = [json.loads(line) for line in (starter / "train.jsonl").read_text().splitlines()[:8]]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**r, "verifier": "starts_with_digit"}) + "\n" for r in rows))
    trace, out = tmp_path / "trace", tmp_path / "run"
    trace.mkdir()
    torchrun(2, "megarl/train.py", _recipe(tmp_path), "--hf-checkpoint", starter, "--prompt-data", data,
             "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2, "--rollout-batch-size", 4,
             "--n-samples-per-prompt", 4, "--micro-batch-size", 8, "--reward-workers", 2,
             "--rollout-function", "tagged_single_turn", "--output-dir", out, "--log-interval", 1,
             "--log-samples-interval", 1, "--log-samples-count", 8, timeout=400,
             extra_env={"EXAMPLE_PLUGIN_TRACE": str(trace)})

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["sample_turns"] == 1.0 and 0.0 <= m["sample_stopped"] <= 1.0 for m in metrics)  # its metadata
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and all(s["turns"] == 1.0 for s in samples)
    for s in samples:  # the plugin's rule with the recipe's option, not the arithmetic verifier's
        assert s["reward"] == float(s["response"][:1] != "" and s["response"][:1] in "13579"), s
    assert any(s["response"][:1] in "02468" for s in samples if s["response"]), "the option must matter here"
    saved = json.loads((out / "config.json").read_text())
    assert saved["config"]["verifier.starts_with_digit"] == {"first_chars": "13579"}
    rollout_pids, verifier_pids = _traced(trace, "rollout"), _traced(trace, "verifier-13579")
    assert len(rollout_pids) == 2, "one rollout per data-parallel rank, in the trainer's processes"
    assert verifier_pids and not verifier_pids & rollout_pids, "the verifier runs in the reward workers"


def test_megarl_verify_scores_rows_with_a_plugin_verifier(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"response": r, "answer": "", "correct": r[:1].isdigit()}) + "\n"
                            for r in ("7 apples", "apples", "", "3")))
    trace = tmp_path / "trace"
    trace.mkdir()
    cmd = [sys.executable, "-m", "megarl.cli.verify", str(rows), "--plugins", PLUGIN, "--verifier",
           "starts_with_digit", "--workers", "1", "--output", str(tmp_path / "scored.jsonl"), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), "EXAMPLE_PLUGIN_TRACE": str(trace)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [s["score"] for s in scored] == [1.0, 0.0, 0.0, 1.0]
    assert "accuracy 100.0% on 4 labelled rows" in stdout
    assert _traced(trace, "verifier-0123456789") and proc.pid not in _traced(trace, "verifier-0123456789"), \
        "scored in a worker process"
    # the plugin verifier's own option is a flag of megarl-verify too, once --plugins is named
    only_seven = subprocess.run([*cmd, "--first-chars", "7"], cwd=REPO, env=env(), capture_output=True, text=True,
                                timeout=120)
    assert only_seven.returncode == 0, only_seven.stderr
    assert [json.loads(line)["score"] for line in (tmp_path / "scored.jsonl").read_text().splitlines()] == \
        [1.0, 0.0, 0.0, 0.0]

    unknown = subprocess.run([*cmd[:6], "--verifier", "starts_with_a_letter"], cwd=REPO, env=env(),
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "starts_with_digit" in unknown.stderr  # the registered names are listed


def _help(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "megarl/train.py", *argv, "--help"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _section(text: str, section: str) -> list[str]:
    """The flags `--help` lists under `section`."""
    lines = text.split(f"\n{section}:\n", 1)[1].splitlines()
    return [line.split()[0] for line in lines[:next(i for i, x in enumerate(lines + [""]) if not x.startswith("  "))]]


PLUGIN_OPTIONS = {"advantage_estimator.scaled_grpo": ["--advantage-scale"],
                  "off_policy_correction.capped_ratio": ["--ratio-cap"],
                  "rollout_backend.traced_builtin": ["--engine-tag"]}


def test_plugin_estimator_correction_and_backend_get_their_options_from_a_recipe(starter, tmp_path):
    recipe = tmp_path / "with_plugin_algorithms.sh"
    recipe.write_text(f"source {REPO}/recipes/tiny_cpu.sh\nPLUGIN_ARGS=(--plugins {PLUGIN})\n"
                      "ALGORITHM_ARGS+=(--advantage-estimator scaled_grpo --advantage-scale 0.5\n"
                      "                 --off-policy-correction capped_ratio --ratio-cap 1.5)\n"
                      "ROLLOUT_ARGS+=(--rollout-backend traced_builtin --engine-tag blue)\n")
    trace, out = tmp_path / "trace", tmp_path / "run"
    trace.mkdir()
    torchrun(1, "megarl/train.py", recipe, "--hf-checkpoint", starter, "--prompt-data", starter / "train.jsonl",
             "--eval-data", "", "--max-train-minutes",
             "0", "--num-steps", 2, "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16,
             "--output-dir", out, "--log-interval", 1, timeout=400, extra_env={"EXAMPLE_PLUGIN_TRACE": str(trace)})

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["capped_ratio_weight_max"] <= 1.5 for m in metrics)  # the correction ran, at the recipe's cap
    # each component got the recipe's value: the estimator and the correction every step, the backend once
    pid = _traced(trace, "backend-blue")
    assert len(pid) == 1 and _traced(trace, "advantage-0.5") == pid and _traced(trace, "correction-1.5") == pid
    assert sorted(p.name.rsplit(".", 1)[0] for p in trace.iterdir()) == ["advantage-0.5", "backend-blue",
                                                                    "correction-1.5"]
    saved = json.loads((out / "config.json").read_text())["config"]
    assert (saved["advantage_estimator.scaled_grpo"], saved["off_policy_correction.capped_ratio"],
            saved["rollout_backend.traced_builtin"]) == ({"advantage_scale": 0.5}, {"ratio_cap": 1.5},
                                                         {"engine_tag": "blue"})


def test_help_lists_each_plugin_option_under_its_component():
    text = _help("--plugins", PLUGIN)
    assert {section: _section(text, section) for section in PLUGIN_OPTIONS} == PLUGIN_OPTIONS
    assert "rollout_backend.traced_builtin:" not in _help()  # without the plugin, no such component
