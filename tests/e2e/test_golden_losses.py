"""The demo recipe's first 20 steps against curves recorded before a refactor (torchtitan's golden-loss check).

`recipes/tiny_cpu.sh` on the test starter at DP=2 with the recipe's seed, for 20 steps (so its learning rate decays
over those 20 steps); once as the recipe stands, and once with a KL penalty and two updates per rollout. The
recipe alone has no KL penalty (so no reference model) and one update per rollout (so the ratio is 1 and nothing
is clipped): the variant runs the reference model and clips, making KL and clip fraction numbers worth comparing.
Reward, loss, KL, clip fraction, gradient norm (and a few more) must equal the recorded ones bit for bit: same code
path, same seeds, same CPU arithmetic. A change that is meant to alter them re-records the files:

    python tests/e2e/test_golden_losses.py --record

and says why in its commit. The KL + clipping variant with the chunked log-prob head (`--logprob-chunk-tokens`)
must give the same samples and curves within float rounding of the recording. Floating-point results depend on the
kernels torch picks for the CPU (and the test starter, built on the same machine, with them), so the curves are kept
per CPU capability
(`torch.backends.cpu.get_cpu_capability()`: `tests/assets/losses/avx512/`, `avx2/`); on a CPU with none recorded
the test skips and says so. The avx512 curves were recorded before the rollout-stage refactor, the avx2 ones at the
commit before the reward-package refactor (both from the code as it then stood).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECORD = "MEGARL_RECORD_GOLDEN"  # set by `--record` below: the test writes this CPU's curves instead of comparing
pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LOSSES = REPO / "tests" / "assets" / "losses"


def assets() -> Path:
    """This CPU's recordings (see the module docstring)."""
    import torch

    return LOSSES / torch.backends.cpu.get_cpu_capability().lower()
STEPS = 20
COMPARED = ("reward_mean", "loss", "kl", "clip_frac", "grad_norm", "accuracy", "entropy", "lr", "response_len",
            "rollout_actor_kl")
RUNS = {"tiny_cpu": [], "tiny_cpu_kl_clip": ["--kl-coef", "0.001", "--updates-per-rollout", "2", "--micro-batch-size",
                                              "16", "--eps-clip", "0.05", "--eps-clip-high", "0.05"]}


def run(starter: Path, out: Path, extra: list[str]) -> list[dict]:
    from helpers import torchrun  # tests/ is on sys.path under pytest (tests/conftest.py)

    torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data",
             starter / "train.jsonl", "--eval-data", "", "--max-train-minutes", "0", "--num-steps", STEPS,
             "--output-dir", out, "--log-interval", STEPS, "--log-samples-interval", 0, *extra, timeout=400)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r[k] for k in COMPARED}} for r in rows]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_first_steps_equal_the_recorded_ones(starter, tmp_path, name):
    recorded = assets() / f"{name}.jsonl"
    if os.environ.get(RECORD) == "1":
        recorded.parent.mkdir(parents=True, exist_ok=True)
        recorded.write_text("".join(json.dumps(r) + "\n" for r in run(starter, tmp_path, RUNS[name])))
        print(f"recorded {recorded}")
        return
    if not recorded.is_file():
        pytest.skip(f"no golden curves recorded on this CPU ({recorded.parent.name}): record them with "
                    "`python tests/e2e/test_golden_losses.py --record` at a commit whose numbers are trusted")
    golden = [json.loads(line) for line in recorded.read_text().splitlines()]
    rows = run(starter, tmp_path, RUNS[name])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(g["loss"] != 0.0 for g in golden), "a vacuous recording"
    if name == "tiny_cpu_kl_clip":
        assert any(g["kl"] > 0 for g in golden) and any(g["clip_frac"] > 0 for g in golden), "nothing to compare"
    for r, g in zip(rows, golden):
        for key in COMPARED:
            assert r[key] == g[key], f"step {r['step']} {key}: {r[key]!r} != recorded {g[key]!r}"


# The chunked log-prob head (--logprob-chunk-tokens, chunks far shorter than a micro-batch's tokens so that every
# sequence spans several) against the full head's recording: equal within float rounding, not bitwise (the chunked
# head sums its soft-max terms in another order). The samples must be the same (reward, accuracy, lengths, clipped
# share, exactly); each continuous curve within 2e-5 of its own scale (its largest value over the run: a GRPO loss
# near 0 is a sum of terms of that size; measured at most 4.1e-6, the loss).
CHUNKED = {"tiny_cpu_kl_clip": ["--logprob-chunk-tokens", "8"]}
EXACT = ("reward_mean", "clip_frac", "accuracy", "lr", "response_len")
SCALE_TOL = 2e-5


@pytest.mark.parametrize("name", sorted(CHUNKED))
def test_chunked_logprobs_give_the_recorded_steps_within_rounding(starter, tmp_path, name):
    recorded = assets() / f"{name}.jsonl"
    if not recorded.is_file():
        pytest.skip(f"no golden curves recorded on this CPU ({recorded.parent.name})")
    golden = [json.loads(line) for line in recorded.read_text().splitlines()]
    rows = run(starter, tmp_path, RUNS[name] + CHUNKED[name])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(g["kl"] > 0 for g in golden), "nothing to compare"
    worst, bad = {}, []
    for key in COMPARED:
        scale = max(abs(g[key]) for g in golden)
        for r, g in zip(rows, golden):
            off = abs(r[key] - g[key]) / scale if scale else abs(r[key] - g[key])
            worst[key] = max(worst.get(key, 0.0), off)
            if (r[key] != g[key]) if key in EXACT else off > SCALE_TOL:
                bad.append(f"step {r['step']} {key}: {r[key]!r} vs {g[key]!r} (scale {scale:.3g})")
    print(f"chunked vs recorded full head, {STEPS} steps of {name}, largest difference over each curve's scale: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert not bad, bad


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/e2e/test_golden_losses.py --record")
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "-s", __file__],
                             cwd=REPO, env={**os.environ, RECORD: "1"}))
