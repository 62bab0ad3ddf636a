"""A user's first run and its restarts, end to end on the starter model (DP=2): over-long prompts left out and
counted, the resolved config saved beside the metrics and in every checkpoint and read back as a recipe, one
command for the first start and every restart (`--save D --load D`), an older step by `--ckpt-step`, held-out
evaluation every `--eval-interval` steps, and no library warnings on the console."""

from __future__ import annotations

import json

import pytest
from helpers import metrics_by_step, torchrun

from megarl.arguments import parse_args

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TRAIN = "megarl/train.py"


@pytest.fixture(scope="module")
def first(starter, tmp_path_factory):
    """Two steps from nothing: 40 training prompts and 2 too long for the starter's 64 positions (56 tokens are
    left for a prompt after 8 for the response), a checkpoint every step, an evaluation every step."""
    root = tmp_path_factory.mktemp("first")
    rows = (starter / "train.jsonl").read_text().splitlines()[:40]
    long = [json.dumps({"prompt": "1" * n + "+1=", "answer": "2", "verifier": "arithmetic"}) for n in (60, 81)]
    data = root / "train.jsonl"
    data.write_text("\n".join(rows[:10] + long[:1] + rows[10:] + long[1:]) + "\n")
    ckpt, out = root / "ckpt", root / "run"
    argv = ["recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", data, "--eval-data",
            starter / "heldout.jsonl", "--eval-max-prompts", 8, "--eval-samples-per-prompt", 2, "--eval-interval", 1,
            "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--save", ckpt,
            "--load", ckpt, "--save-interval", 1, "--output-dir", out, "--log-interval", 1]
    # PYTHONWARNINGS empty: the warnings a user sees by default (the test helpers silence them otherwise)
    proc = torchrun(2, TRAIN, *argv, "--num-steps", 2, timeout=400, extra_env={"PYTHONWARNINGS": ""},
                    fork=False)  # the README's command itself: torchrun starting fresh interpreters
    return {"argv": [str(a) for a in argv], "proc": proc, "ckpt": ckpt, "out": out, "root": root, "data": data}


def test_long_prompts_are_left_out_and_counted(first):
    out = first["proc"].stdout
    assert "left out 2 of 42 --prompt-data prompts longer than 56 tokens" in out
    assert f"{first['data']}:11 (63 tokens), {first['data']}:42 (84 tokens)" in out
    rows = metrics_by_step(first["out"])
    assert sorted(rows) == [1, 2] and all(r["prompts_too_long"] == 2 and r["eval_prompts_too_long"] == 0
                                           for r in rows.values())


def test_the_first_start_needs_no_checkpoint_and_the_console_has_no_warnings(first):
    proc = first["proc"]
    assert f"--load {first['ckpt']} holds no checkpoint yet: starting afresh from --hf-checkpoint" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert (first["ckpt"] / "latest").read_text().strip() == "iter_0000002"


def test_held_out_accuracy_every_interval(first):
    rows = metrics_by_step(first["out"])
    assert 0.0 <= rows[1]["eval_sampled"] <= 1.0 and 0.0 <= rows[1]["eval_greedy"] <= 1.0
    assert "eval_sampled" not in rows[2], "the last step's evaluation is the final one (eval.json)"
    assert set(json.loads((first["out"] / "eval.json").read_text())) >= {"before", "after"}
    assert "step 1: held-out sampled" in first["proc"].stdout


def test_the_resolved_config_is_saved_and_reads_back(first):
    saved = json.loads((first["out"] / "config.json").read_text())
    assert saved["world_size"] == 2 and saved["prompts_too_long"] == 2 and saved["padded_vocab_size"] > 0
    assert saved["origins"]["eval_interval"] == "command line" and saved["origins"]["lr"].startswith("recipe ")
    assert saved["config"]["training"]["num_steps"] == 2 and saved["config"]["data"]["max_prompt_len"] == 0
    again = parse_args([str(first["out"] / "config.json")], check_registries=False)
    assert again == parse_args(first["argv"] + ["--num-steps", "2"], check_registries=False)
    in_checkpoint = json.loads((first["ckpt"] / "iter_0000002" / "config.json").read_text())
    assert in_checkpoint["config"] == saved["config"]


def test_an_older_step_from_the_saved_config_repeats_the_run(first):
    """The saved config as the recipe, resuming from step 1's checkpoint: step 2 as the first run had it."""
    out = first["root"] / "again"
    proc = torchrun(2, TRAIN, first["out"] / "config.json", "--ckpt-step", 1, "--save", "", "--eval-interval", 0,
                    "--output-dir", out, timeout=400)
    assert f"resumed from {first['ckpt'] / 'iter_0000001'} at step 1" in proc.stdout
    mine, theirs = metrics_by_step(out)[2], metrics_by_step(first["out"])[2]
    for key in ("reward_mean", "loss", "grad_norm", "response_len", "lr"):
        assert mine[key] == theirs[key], key


def test_the_same_command_resumes_after_the_first_start(first):
    """Run last: it saves step 3, which prunes step 1's checkpoint (--keep-last 2)."""
    proc = torchrun(2, TRAIN, *first["argv"], "--num-steps", 3, timeout=400)
    assert f"resumed from {first['ckpt'] / 'iter_0000002'} at step 2" in proc.stdout
    assert sorted(metrics_by_step(first["out"])) == [1, 2, 3]
