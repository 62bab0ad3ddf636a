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


def test_the_build_speaks_at_once_and_warns_before_a_deadline_strikes(tmp_path, monkeypatch, capsys):
    """On a clock that moves 1 s per reading (2 s a step): a line at the first step and at least every 30 s, and a
    warning at step 20, while 40 s of the 60 s deadline have passed, that 1,000 steps will not make it."""
    from megarl.tasks.arithmetic import build_tokenizer, split_problems

    clock = iter(range(10**6))
    monkeypatch.setattr(starter.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(starter, "BATCH", 4)  # the model's steps themselves do not matter here
    tokenizer = build_tokenizer(tmp_path)
    train, _ = split_problems(seed=0)
    with pytest.raises(starter.OutOfTime, match="passed --minutes 1 at step 30 of 1000"):
        starter.pretrain(starter.build_model(tokenizer), tokenizer, train, steps=1000, seed=0, minutes=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step     1/1000")
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning:"))
    assert "at 2.05 s a step the 1000 steps need ~34.2 min, past --minutes 1: the build will stop" in lines[warning]
    steps = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step")]
    assert steps == [1, 17] and warning == 2, lines  # step 17: more than 30 s after step 1
