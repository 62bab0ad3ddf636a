"""The demo's starter model is bound by its step count: the schedule runs over exactly `--steps` steps, and a
`--minutes` deadline stops the build with a message (writing nothing) instead of shortening it."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import make_starter_model as starter  # noqa: E402


def test_pretrain_takes_its_steps_with_the_schedule_over_them(tmp_path, monkeypatch):
    from megarl.tasks.arithmetic import build_tokenizer, split_problems

    tokenizer = build_tokenizer(tmp_path)
    train, _ = split_problems(seed=0)
    seen = []
    schedule = starter.learning_rate
    monkeypatch.setattr(starter, "learning_rate", lambda step, progress: seen.append((step, progress)) or
                        schedule(step, progress))
    assert starter.pretrain(starter.build_model(tokenizer), tokenizer, train, steps=4, seed=0) == 4
    assert seen == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]  # the cosine's progress is the step's, not the clock's


def test_a_deadline_stops_the_build_and_writes_nothing(tmp_path):
    out = tmp_path / "starter"
    with pytest.raises(SystemExit, match=r"passed --minutes 1e-06 at step \d+ of 50 .*nothing was written"):
        starter.main(["--out", str(out), "--steps", "50", "--minutes", "1e-6"])
    assert list(tmp_path.iterdir()) == [], "no starter and no half-made directory"
