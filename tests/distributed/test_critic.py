"""The PPO critic on CPU/gloo: it fits fixed returns on a fixed batch, and DP=2, TP=2 and PP=2 give the values
DP=1 gives (the replicated value head needs no TP reduction; its trunk gradient is complete on every TP rank)."""

from __future__ import annotations

import pytest
import torch
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/distributed/critic_worker.py"
LAYOUTS = {"dp1": (1, 1, 1), "dp2": (2, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2)}  # nproc, tp, pp


@pytest.fixture(scope="module")
def fits(tiny_qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("critic")
    results = {}
    for name, (nproc, tp, pp) in LAYOUTS.items():
        torchrun(nproc, WORKER, "--hf", tiny_qwen2, "--out", out, "--layout", name, "--tp", tp, "--pp", pp, timeout=180)
        results[name] = [torch.load(out / f"critic-{name}-rank{r}.pt", weights_only=False) for r in range(nproc)]
    return results


def _values(results, key):
    """This layout's values for the whole batch, from the last-stage TP-rank-0 of each DP rank, in row order."""
    by_dp = {}
    for r in results:
        if r[key] is not None:
            by_dp.setdefault(r["dp_rank"], r[key])
    return torch.cat([by_dp[d] for d in sorted(by_dp)], dim=0)


def test_value_head_starts_at_zero_and_loss_decreases(fits):
    r = fits["dp2"]
    assert torch.equal(_values(r, "initial"), torch.zeros_like(_values(r, "initial")))
    losses = r[0]["losses"]
    assert all(rank["losses"] == losses for rank in r), "every rank reports the same global loss"
    # Returns are +1 / -0.5 per row: a zero critic starts at the mean squared return over 2.
    assert losses[-1] < 0.35 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_layouts_match_dp1(fits, layout):
    want = _values(fits["dp1"], "final")
    got = _values(fits[layout], "final")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for a, b in zip(fits[layout][0]["losses"], fits["dp1"][0]["losses"]):
        assert abs(a - b) < 1e-5 * max(1.0, b), (layout, a, b)
