"""`megarl-eval` end to end on the test starter: the trainer's own held-out evaluation of the same weights and seed
gives the same figures (before training: the HF starter; after a step: the megarl checkpoint), and a megarl
checkpoint and its HF export give the same figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, env, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The evaluation both the trainer and megarl-eval run: 12 held-out prompts, 4 samples each and greedy, seed 5.
EVAL = ["--eval-max-prompts", "12", "--eval-samples-per-prompt", "4", "--seed", "5"]


def megarl_eval(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.eval", *map(str, args)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def trained(starter, tmp_path_factory):
    """One step of the CPU demo's recipe on one process (DP 1: the trainer evaluates every prompt in one batch
    with seed + 17, as megarl-eval does), saved as a megarl checkpoint and exported to HF."""
    root = tmp_path_factory.mktemp("evalcli")
    torchrun(1, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data",
             starter / "train.jsonl", "--eval-data", starter / "heldout.jsonl", *EVAL, "--num-steps", 1,
             "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--lr", "1e-3",
             "--save", root / "ckpt", "--save-hf", root / "hf", "--output-dir", root / "run", timeout=400)
    return root, json.loads((root / "run" / "eval.json").read_text())


def _figures(out):
    return json.loads((out / "eval.json").read_text())


def test_on_the_starter_pass_at_1_is_the_trainers_sampled_accuracy(starter, trained):
    root, trainer = trained
    out = root / "starter_eval"
    proc = megarl_eval("recipes/tiny_cpu.sh", "--checkpoint", starter, "--data", starter / "heldout.jsonl", *EVAL,
                       "--out", out)
    got = _figures(out)
    before = trainer["before"]
    assert got["format"] == "hf" and got["overall"]["prompts"] == 12 and got["samples_per_prompt"] == 4
    assert got["overall"]["pass@1"]["value"] == before["sampled"]
    assert got["overall"]["greedy"]["value"] == before["greedy"]
    assert got["overall"]["pass@4"]["value"] == before["pass@4"]
    assert got["overall"]["maj@4"]["value"] == before["maj@4"]
    # the table, printed and written, and each prompt's verdicts
    table = (out / "eval.md").read_text()
    assert "| source | prompts | pass@1 | pass@4 | maj@4 | greedy |" in table and table.strip() in proc.stdout
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(len(r["correct"]) == 4 and r["source"] == "arithmetic" for r in rows)
    share = sum(map(sum, (r["correct"] for r in rows))) / 48
    assert got["overall"]["pass@1"]["value"] == pytest.approx(share)
    lo, hi = got["overall"]["pass@1"]["ci"]
    assert lo <= share <= hi


def test_a_megarl_checkpoint_and_its_hf_export_give_the_trainers_final_figures(trained):
    """The checkpoint brings its run's settings (its config.json is the recipe); its HF export, evaluated with that
    config, gives the same figures, intervals included, and both equal the trainer's evaluation after the step."""
    root, trainer = trained
    megarl_eval("--checkpoint", root / "ckpt", "--out", root / "ckpt_eval")
    ckpt = _figures(root / "ckpt_eval")
    config = root / "ckpt" / "iter_0000001" / "config.json"
    megarl_eval(config, "--checkpoint", root / "hf", "--out", root / "hf_eval")
    hf = _figures(root / "hf_eval")
    assert ckpt["format"] == "megarl" and ckpt["step"] == 1 and hf["format"] == "hf"
    assert ckpt["data"].endswith("heldout.jsonl") and ckpt["overall"]["prompts"] == 12
    assert ckpt["overall"] == hf["overall"] and ckpt["by_source"] == hf["by_source"]
    after = trainer["after"]
    assert after != trainer["before"], "the step changed no figure: the comparison could not tell the weights apart"
    assert ckpt["overall"]["pass@1"]["value"] == after["sampled"]
    assert ckpt["overall"]["greedy"]["value"] == after["greedy"]
    assert ckpt["overall"]["maj@4"]["value"] == after["maj@4"]


def test_a_plugins_verifier_judges_every_row_through_the_reward_pool(starter, tmp_path):
    """Any registered verifier, with its own options as flags: `starts_with_digit` (tests/e2e/example_plugin.py)
    judges by the response's first character, which it also reports as the extracted answer."""
    out = tmp_path / "plugin_eval"
    megarl_eval("recipes/tiny_cpu.sh", "--checkpoint", starter, "--data", starter / "heldout.jsonl",
                "--eval-max-prompts", 6, "--eval-samples-per-prompt", 3, "--plugins", "tests/e2e/example_plugin.py",
                "--verifier", "starts_with_digit", "--first-chars", "0123", "--reward-workers", 2, "--out", out)
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    verdicts = [(a is not None and a != "" and a in "0123") for r in rows for a in r["answers"]]
    assert [c for r in rows for c in r["correct"]] == verdicts and len(verdicts) == 18
    assert 0 < sum(verdicts) < 18, "every verdict the same: the check could not tell the verifier's rule"
    got = _figures(out)
    assert got["verifier"] == "starts_with_digit"
    assert got["overall"]["pass@1"]["value"] == pytest.approx(sum(verdicts) / 18)


def test_a_lora_checkpoint_is_its_adapters_on_their_base(starter, tmp_path):
    """A LoRA run's checkpoint holds the adapters only: megarl-eval loads them on the base and the engine gets the
    merged weights the trainer synced, so the figures are the trainer's after its steps."""
    torchrun(1, "megarl/train.py", "recipes/tiny_cpu_lora.sh", "--hf-checkpoint", starter, "--prompt-data",
             starter / "train.jsonl", "--eval-data", starter / "heldout.jsonl", *EVAL, "--num-steps", 2,
             "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--lr", "3e-3",
             "--save", tmp_path / "ckpt", "--output-dir", tmp_path / "run", timeout=400)
    trainer = json.loads((tmp_path / "run" / "eval.json").read_text())
    megarl_eval("--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "eval")
    got = _figures(tmp_path / "eval")["overall"]
    after = trainer["after"]
    assert after != trainer["before"], "the steps changed no figure: the comparison could not tell the weights apart"
    assert (got["pass@1"]["value"], got["greedy"]["value"], got["pass@4"]["value"], got["maj@4"]["value"]) == (
        after["sampled"], after["greedy"], after["pass@4"], after["maj@4"])
