"""`train.py --rollout-function verifiers` for 2 steps on 2 ranks with the built-in engine: every sample the
function returned holds the tokens and log-probs the engine generated for it and the reward of its verifiers
trace, its group is its prompt's, and the run trains on them (both steps logged, the weights moved to version 2).
The rollout function is the `verifiers` one with a recorder around the engine (`verifiers_recording_plugin.py`)."""

from __future__ import annotations

import json

import pytest
from helpers import make_tiny_hf_model, metrics_by_step, torchrun
from verifiers_testenv import HERE, first_line_reward, with_chat_template

from megarl.tasks.arithmetic import all_problems, build_tokenizer, write_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # the environment: conftest.py


def test_two_training_steps_on_verifiers_episodes(tmp_path):
    raw = make_tiny_hf_model(tmp_path / "raw", vocab=96, seed=4)
    build_tokenizer(raw)
    model = with_chat_template(raw, tmp_path / "m")
    problems = all_problems()[::97][:16]
    data = tmp_path / "train.jsonl"
    write_jsonl(data, problems)
    record = tmp_path / "record"
    record.mkdir()
    out = tmp_path / "run"
    torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", model, "--prompt-data", data,
             "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2, "--rollout-batch-size", 4,
             "--n-samples-per-prompt", 4, "--micro-batch-size", 8, "--output-dir", out, "--log-interval", 1,
             "--plugins", str(HERE / "verifiers_recording_plugin.py"),
             "--rollout-function", "verifiers_recorded", "--verifiers-taskset", "megarl_sum_taskset",
             "--verifiers-path", str(HERE), "--verifiers-timeout", 300,
             extra_env={"MEGARL_SUM_ROWS": str(data), "MEGARL_VERIFIERS_RECORD": str(record)}, timeout=900)

    metrics = metrics_by_step(out)
    assert sorted(metrics) == [1, 2]
    tok = build_tokenizer()
    answers = [str(p.answer) for p in problems]
    calls = 0
    for rank in (0, 1):
        rows = [json.loads(line) for line in (record / f"rank{rank}.jsonl").read_text().splitlines()]
        generated = [(r["prompt"], r["tokens"], r["logprobs"]) for r in rows if r["kind"] == "engine"]
        episodes = [e for r in rows if r["kind"] == "episodes" for e in r["episodes"]]
        samples = [r for r in rows if r["kind"] == "sample"]
        assert len(samples) == len(episodes) == len(generated) == 2 * 2 * 4  # 2 steps x 2 prompts x 4 a rank
        calls += sum(r["kind"] == "engine" for r in rows)
        for i, (s, episode) in enumerate(zip(samples, episodes)):
            assert (s["prompt"], s["response"], s["logprobs"]) in generated  # the engine's tokens, verbatim
            generated.remove((s["prompt"], s["response"], s["logprobs"]))
            assert s["mask"] == [1] * len(s["response"])
            assert s["reward"] == episode["reward"]  # the trace's reward
            assert s["reward"] == first_line_reward(s["text"], answers[s["prompt_index"]])
            assert s["prompt"] == tok.encode(problems[s["prompt_index"]].prompt)
            assert s["group"] == (i % 8) // 4  # 4 episodes of one prompt make a group
            assert episode["task"] == s["prompt_index"]
    for step in (1, 2):
        assert metrics[step]["sample_verifiers_failed"] == 0.0
