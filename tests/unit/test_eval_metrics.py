"""pass@k, maj@k and the bootstrap of `megarl.evaluation.metrics` against hand computations on fixed tables, and
`megarl-eval`'s refusals of bad input before any model is built."""

from __future__ import annotations

import json
from math import comb

import numpy as np
import pytest

from megarl.cli import eval as eval_cli
from megarl.evaluation.metrics import (PromptResult, bootstrap_ci, by_subset, check_ks, maj_at_k, pass_at_k,
                                       per_prompt, subset, summarize)


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 0, 1, 0.0),            # no correct sample: never
    (5, 0, 5, 0.0),
    (5, 5, 1, 1.0),            # every sample correct: always
    (5, 5, 3, 1.0),
    (5, 2, 1, 2 / 5),          # k = 1: c / n
    (5, 2, 2, 1 - 3 / 10),     # 1 - C(3,2)/C(5,2): of the 10 pairs, 3 hold no correct sample
    (5, 1, 3, 1 - 4 / 10),     # 1 - C(4,3)/C(5,3)
    (5, 2, 4, 1.0),            # n - c = 3 < k = 4: every draw of 4 holds a correct one
    (5, 1, 5, 1.0),            # k = n: solved when any sample is
    (4, 0, 4, 0.0),
    (10, 3, 5, 1 - 21 / 252),  # C(7,5) = 21, C(10,5) = 252
])
def test_pass_at_k_equals_the_hand_computation(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_the_chance_a_random_draw_of_k_holds_a_correct_sample():
    """Enumerating every draw of k of the n samples (the definition) gives the closed form."""
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            verdicts = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                draws = list(combinations(verdicts, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws), abs=1e-12)


@pytest.mark.parametrize("k", [0, 6, 9])
def test_pass_at_k_refuses_k_outside_one_to_n(k):
    with pytest.raises(ValueError, match=rf"pass@{k} needs 1 <= k <= the samples per prompt \(5\)"):
        pass_at_k(5, 2, k)


def test_k_above_the_samples_is_refused_with_the_way_out():
    check_ks([1, 4], 4)
    with pytest.raises(ValueError, match=r"--k 8 is more than the 4 samples per prompt.*at least 8, or drop k=8"):
        check_ks([1, 8], 4, what="--k")


@pytest.mark.parametrize("answers, correct, k, expected", [
    (["3", "4", "3", None], [True, False, True, False], 4, 1.0),   # "3" twice, "4" once
    (["4", "4", "3", "3", "3"], [False, False, True, True, True], 5, 1.0),
    (["4", "4", "3", "3", "3"], [False, False, True, True, True], 4, 0.0),  # first 4: a tie, "4" came first
    (["4", "3"], [False, True], 2, 0.0),                             # a tie goes to the first answer
    (["3", "4"], [True, False], 2, 1.0),
    ([None, None, None], [False, False, False], 3, 0.0),              # nobody answered
    ([None, "5", None], [False, True, False], 3, 1.0),                # abstentions do not vote
    ([" 7", "7 ", "8"], [True, True, False], 3, 1.0),                 # whitespace stripped
    (["9"], [True], 1, 1.0),
    (["9", "1", "1"], [True, False, False], 1, 1.0),                  # maj@1: the first sample alone
])
def test_maj_at_k_equals_the_hand_vote(answers, correct, k, expected):
    assert maj_at_k(answers, correct, k) == expected


def test_maj_at_k_refuses_k_above_the_samples():
    with pytest.raises(ValueError, match=r"maj@3 needs 1 <= k <= the samples per prompt \(2\)"):
        maj_at_k(["1", "2"], [True, False], 3)


def test_subsets_are_the_rows_source_without_the_row_number_or_the_verifier():
    assert subset("humaneval:12", "code") == "humaneval"
    assert subset("gsm8k", "math") == "gsm8k"
    assert subset("reasoning_gym:chain_sum:3", "reasoning_gym") == "reasoning_gym:chain_sum"
    assert subset("", "arithmetic") == "arithmetic"


# A fixed table: 5 prompts, 4 samples each, in two sources.
TABLE = [
    PromptResult("a", (True, True, False, False), ("1", "1", "2", "2")),      # c=2, tie -> "1" (correct)
    PromptResult("a", (False, False, False, False), ("5", "6", "5", None)),  # c=0
    PromptResult("a", (True, True, True, True), ("3", "3", "3", "3")),       # c=n
    PromptResult("b", (False, True, False, False), ("7", "8", "7", "7")),    # c=1, majority "7" wrong
    PromptResult("b", (False, False, False, True), ("2", "4", "6", "9")),    # c=1, all differ -> "2" wrong
]


def test_summary_of_a_fixed_table_equals_the_hand_computation():
    # pass@1 per prompt: c/4 = .5, 0, 1, .25, .25; pass@2 = 1 - C(4-c,2)/6 = 5/6, 0, 1, 1/2, 1/2;
    # pass@4 = 1, 0, 1, 1, 1; maj@4 = 1, 0, 1, 0, 0
    got = by_subset(TABLE, ["pass@1", "pass@2", "pass@4", "maj@4"], resamples=0)
    overall, a, b = got["overall"], got["by_source"]["a"], got["by_source"]["b"]
    assert overall["prompts"] == 5 and overall["samples"] == 20 and list(got["by_source"]) == ["a", "b"]
    assert overall["pass@1"] == {"value": pytest.approx(2 / 5), "ci": None}  # (.5 + 0 + 1 + .25 + .25) / 5
    assert overall["pass@2"]["value"] == pytest.approx((5 / 6 + 0 + 1 + 1 / 2 + 1 / 2) / 5)
    assert overall["pass@4"]["value"] == pytest.approx(4 / 5)
    assert overall["maj@4"]["value"] == pytest.approx(2 / 5)
    assert a["prompts"] == 3 and a["pass@1"]["value"] == pytest.approx(1.5 / 3) and a["maj@4"]["value"] == 2 / 3
    assert b["prompts"] == 2 and b["pass@1"]["value"] == pytest.approx(0.25) and b["maj@4"]["value"] == 0.0
    assert b["pass@4"]["value"] == 1.0


def test_the_bootstrap_of_a_constant_is_that_constant():
    lo, hi = bootstrap_ci(np.full(7, 0.25), resamples=200, seed=3, confidence=0.95)
    assert lo == hi == 0.25


def test_the_bootstrap_of_two_prompts_follows_the_binomial_by_hand():
    """Two prompts worth 0 and 1: a resample's mean is 0, 1/2 or 1 with chances 1/4, 1/2, 1/4. The 95 % interval's
    quantiles (2.5 %, 97.5 %) fall in the outer masses, the 40 % interval's (30 %, 70 %) in the middle one."""
    values = np.array([0.0, 1.0])
    assert bootstrap_ci(values, resamples=4000, seed=0, confidence=0.95) == (0.0, 1.0)
    assert bootstrap_ci(values, resamples=4000, seed=0, confidence=0.4) == (0.5, 0.5)


def test_the_bootstrap_draws_prompts_with_replacement_as_documented():
    """An independent re-computation of the documented procedure: PCG64 seeded draws of prompt indices, the mean
    of each draw, numpy's linear percentile; the same seed gives the same interval, another seed another."""
    values = per_prompt(TABLE, "pass@2")
    rng = np.random.default_rng(11)
    means = [values[rng.integers(0, 5, size=(1, 5))][0].mean() for _ in range(300)]
    expected = tuple(np.percentile(means, [5.0, 95.0]))
    got = bootstrap_ci(values, resamples=300, seed=11, confidence=0.9)
    assert got == pytest.approx(expected, abs=1e-12)
    assert bootstrap_ci(values, resamples=300, seed=11, confidence=0.9) == got
    assert bootstrap_ci(values, resamples=300, seed=12, confidence=0.9) != got
    assert got[0] <= summarize(TABLE, ["pass@2"], resamples=0)["pass@2"]["value"] <= got[1]


def test_every_figure_of_a_set_gets_an_interval_that_holds_its_value():
    got = summarize(TABLE, ["pass@1", "maj@4"], resamples=500, seed=0, confidence=0.95)
    for metric in ("pass@1", "maj@4"):
        lo, hi = got[metric]["ci"]
        assert 0.0 <= lo <= got[metric]["value"] <= hi <= 1.0


def test_comb_reference_for_large_n():
    """pass@k stays exact where C(n, k) is beyond a float's integers."""
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - comb(197, 100) / comb(200, 100), abs=1e-15)


# ---- megarl-eval's refusals, before any model is built ----------------------------------------------------------


@pytest.fixture()
def hf_dir(tmp_path):
    """Enough of an HF directory for the command line's checks (they read config.json only)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "verifier": "arithmetic"}) + "\n")
    return d, data


def _error(capsys, argv) -> str:
    assert eval_cli.main([str(a) for a in argv]) == 2
    return capsys.readouterr().err


def test_k_above_the_samples_per_prompt_is_a_usage_error(hf_dir, capsys, tmp_path):
    d, data = hf_dir
    err = _error(capsys, ["--checkpoint", d, "--data", data, "--k", "1,8", "--eval-samples-per-prompt", 4,
                          "--out", tmp_path / "o"])
    assert "--k 1,8: --k 8 is more than the 4 samples per prompt" in err and "--eval-samples-per-prompt 4" in err


def test_bad_checkpoints_data_and_outputs_are_refused_by_name(hf_dir, capsys, tmp_path):
    d, data = hf_dir
    assert "--checkpoint /nonexistent: no such directory" in _error(capsys, ["--checkpoint", "/nonexistent"])
    assert "neither a megarl checkpoint" in _error(capsys, ["--checkpoint", tmp_path, "--data", data])
    err = _error(capsys, ["--checkpoint", d, "--data", "gsm9k", "--out", tmp_path / "o"])
    assert "--data gsm9k: no such file, and no dataset of that name (datasets: humaneval, arithmetic" in err
    assert "--data is required" in _error(capsys, ["--checkpoint", d])
    assert "--verifier nope:" in _error(capsys, ["--checkpoint", d, "--data", data, "--verifier", "nope"])
    assert "--confidence 1.5: must be in (0, 1)" in _error(capsys, ["--checkpoint", d, "--data", data,
                                                                     "--confidence", 1.5])
    out = tmp_path / "done"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    err = _error(capsys, ["--checkpoint", d, "--data", data, "--out", out])
    assert "already holds an eval.json" in err and (out / "eval.json").read_text() == "{}"


def test_the_plan_takes_the_trainer_flags_and_defaults_k_to_one_and_n(hf_dir, tmp_path):
    d, data = hf_dir
    p = eval_cli.plan(["recipes/tiny_cpu.sh", "--checkpoint", str(d), "--data", str(data),
                       "--eval-samples-per-prompt", "3", "--rollout-temperature", "0.7", "--out", str(tmp_path / "o")])
    assert p.ks == [1, 3] and p.metrics == ["pass@1", "pass@3", "maj@3"] and p.megatron is None
    assert p.cfg.model.hf_checkpoint == str(d) and p.cfg.rollout.rollout_temperature == 0.7
    assert p.cfg.rollout.max_response_len == 8  # the recipe's


def test_the_table_has_a_row_per_source_and_the_overall():
    result = {"checkpoint": "ck", "data": "rows", "samples_per_prompt": 4, "sampling": {"temperature": 1.0},
              "metrics": ["pass@1", "maj@4"], "bootstrap": {"resamples": 10, "confidence": 0.9},
              **by_subset(TABLE, ["pass@1", "maj@4"], resamples=10, seed=0, confidence=0.9)}
    lines = eval_cli.markdown_table(result).splitlines()
    assert lines[0] == "ck on rows: 4 samples a prompt, temperature 1, [90 % interval]"
    assert lines[2] == "| source | prompts | pass@1 | maj@4 |"
    assert lines[4].startswith("| a | 3 | 50.0 % [") and lines[5].startswith("| b | 2 | 25.0 % [")
    assert lines[6].startswith("| **overall** | 5 | 40.0 % [")


def test_sample_and_score_groups_each_prompts_verdicts_and_answers_in_order():
    from megarl.data import PromptRecord
    from megarl.evaluation.generate import accuracy_sums, sample_and_score
    from megarl.rollout.base import SamplingParams
    from megarl.samples import Sample, SampleStatus

    prompts = [PromptRecord(0, "1+1=", [1], "2", "arithmetic", "f:1", None, "tiny:0"),
               PromptRecord(1, "2+2=", [2], "4", "arithmetic", "f:2")]
    outcomes = [("correct", "2"), ("incorrect", "3"), ("incorrect", None), ("correct", "4")]

    def rollout(engine, records, params, reward, tokenizer):
        return [Sample(group=i // params.n, prompt_index=i // params.n, prompt_ids=[], response_ids=[], loss_mask=[],
                       rollout_logprobs=[], weight_version=0, status=SampleStatus.COMPLETED, outcome=o, extracted=a)
                for i, (o, a) in enumerate(outcomes[: len(records) * params.n])]

    results = sample_and_score(rollout, None, prompts, SamplingParams(n=2), None, None)
    assert results == [PromptResult("tiny", (True, False), ("2", "3")),
                       PromptResult("arithmetic", (False, True), (None, "4"))]
    assert accuracy_sums(results) == (1.0, 2)  # pass@1: 1/2 + 1/2
    with pytest.raises(RuntimeError, match="returned 4 samples for 2 prompts x 3"):
        sample_and_score(rollout, None, prompts, SamplingParams(n=3), None, None)
