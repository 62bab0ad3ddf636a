"""The run's reward-hacking monitor: the verifiers' signals (`megarl.verifiers.signals`) counted per step, a
window over steps, and the alarm (`--hack-alarm RATE`, `--stop-on-hacking`).

Per step (`hack_counts`, summed over ranks by `megarl.stages.report`): `hack/<category>`, the share of the step's
samples that carried that signal, and `hack/any`, the share that carried any. Over the last `--hack-window` steps
(`HackMonitor`): each category's rate (flagged samples / samples of the window) against `--hack-alarm`, and
`hack/rm_length_corr`, the Pearson correlation of a reward model's score with the response length over the
window's rows a model scored (`rm_len_*` sums from `RewardMeter.health`): a model that pays for length shows it
there long before the rule's accuracy moves.

Signals change no reward: they are read after the verdict, and a run with them off (`--no-code-signals`,
`--no-math-signals`) trains the same numbers. Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from megarl.verifiers.signals import CATEGORIES

COUNT_KEYS = [f"hack_n_{c}" for c in CATEGORIES] + ["hack_n_any"]
RM_LEN_KEYS = ["rm_len_n", "rm_len_sx", "rm_len_sy", "rm_len_sxx", "rm_len_syy", "rm_len_sxy"]


def hack_counts(samples: Sequence) -> dict[str, float]:
    """Of a batch's samples (anything with `.signals`): how many carried each category, and any."""
    out = {k: 0.0 for k in COUNT_KEYS}
    for s in samples:
        signals = getattr(s, "signals", None) or {}
        for c in signals:
            if f"hack_n_{c}" in out:
                out[f"hack_n_{c}"] += 1
        out["hack_n_any"] += bool(signals)
    return out


def rm_length_sums(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    """(model score, response length) pairs as the sums a correlation is taken from (they add up over ranks)."""
    if not pairs:
        return {}
    xs, ys = [float(x) for x, _ in pairs], [float(y) for _, y in pairs]
    return dict(zip(RM_LEN_KEYS, (len(xs), sum(xs), sum(ys), sum(x * x for x in xs), sum(y * y for y in ys),
                                  sum(x * y for x, y in zip(xs, ys)))))


def correlation(n: float, sx: float, sy: float, sxx: float, syy: float, sxy: float) -> float | None:
    """Pearson's r from sums; None with fewer than 3 points or no spread."""
    if n < 3:
        return None
    vx, vy = n * sxx - sx * sx, n * syy - sy * sy
    if vx <= 1e-12 * max(1.0, n * sxx) or vy <= 1e-12 * max(1.0, n * syy):
        return None
    return (n * sxy - sx * sy) / math.sqrt(vx * vy)


def step_rates(g: dict, n: float) -> dict[str, float]:
    """`hack/<category>` and `hack/any` of a step from its summed counts (`g`) and its samples (`n`)."""
    n = max(n, 1.0)
    out = {f"hack/{c}": g.get(f"hack_n_{c}", 0.0) / n for c in CATEGORIES}
    out["hack/any"] = g.get("hack_n_any", 0.0) / n
    out.update({k: g[k] for k in RM_LEN_KEYS if g.get("rm_len_n", 0) > 0})
    return out


class HackMonitor:
    """The window over steps and the alarm. `observe(row, n_samples)` takes a step's metrics row (its `hack/*`
    rates and `rm_len_*` sums) and its sample count, adds `hack/rm_length_corr` to the row when a model scored
    rows in the window, and returns the alarm's message when a category's rate over the window passes `alarm`
    (None otherwise)."""

    def __init__(self, window: int = 10, alarm: float = 0.0):
        if window < 1:
            raise ValueError(f"--hack-window must be >= 1, got {window}")
        self.alarm = alarm
        self.steps: deque[tuple[float, dict[str, float], dict[str, float]]] = deque(maxlen=window)

    def observe(self, row: dict, n_samples: float) -> str | None:
        counts = {c: row.get(f"hack/{c}", 0.0) * n_samples for c in CATEGORIES}
        self.steps.append((n_samples, counts, {k: row.get(k, 0.0) for k in RM_LEN_KEYS}))
        sums = [sum(s[2][k] for s in self.steps) for k in RM_LEN_KEYS]
        r = correlation(*sums)
        if r is not None:
            row["hack/rm_length_corr"] = r
        if self.alarm <= 0:
            return None
        total = sum(s[0] for s in self.steps)
        rates = {c: sum(s[1][c] for s in self.steps) / max(total, 1.0) for c in CATEGORIES}
        over = sorted(((rate, c) for c, rate in rates.items() if rate > self.alarm), reverse=True)
        if not over:
            return None
        said = ", ".join(f"{c} {100 * rate:.1f}%" for rate, c in over)
        return (f"reward hacking: over the last {len(self.steps)} steps ({int(total)} samples) {said} of samples "
                f"carried the signal (--hack-alarm {self.alarm:g})")


def flagged_rows(step: int, samples: Sequence, prompts: Sequence) -> list[dict]:
    """The samples that carried a signal, as `samples.jsonl` rows with their evidence (`signals`)."""
    rows = []
    for s in samples:
        if not s.signals:
            continue
        record = prompts[s.prompt_index]
        rows.append({"step": step, "prompt_index": s.prompt_index, "prompt": record.prompt, "answer": record.label,
                     "verifier": record.verifier, "response": s.response_text, "reward": float(s.reward),
                     "outcome": s.outcome, "response_len": len(s.response_ids), "status": s.status.value,
                     "weight_version": s.weight_version, "signals": dict(s.signals), "flagged": True,
                     **s.metadata})
    return rows
