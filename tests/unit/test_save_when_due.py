"""`megarl.trainer.checkpoints.save_when_due`, the end of every training step: a checkpoint when one is due, and
the stops that save first (--stop-on-hacking, --max-train-minutes), as train.py's loop had them inline."""

from types import SimpleNamespace

import pytest

from megarl.trainer import checkpoints


def _run(save="/ckpt", save_interval=0, num_steps=10, max_train_minutes=0.0, stop_on_hacking=False):
    cfg = SimpleNamespace(training=SimpleNamespace(num_steps=num_steps, max_train_minutes=max_train_minutes),
                          checkpoint=SimpleNamespace(save=save, save_interval=save_interval),
                          logging=SimpleNamespace(stop_on_hacking=stop_on_hacking))
    agreed = []
    return SimpleNamespace(cfg=cfg, agree_any=lambda flag: agreed.append(bool(flag)) or bool(flag), agreed=agreed)


@pytest.fixture
def saved(monkeypatch):
    steps = []
    monkeypatch.setattr(checkpoints, "save", lambda run, step: steps.append(step))
    return steps


def test_saves_at_the_interval_and_the_last_step_and_goes_on(saved):
    run = _run(save_interval=3)
    assert [checkpoints.save_when_due(run, s, alarm=False, elapsed=1.0) for s in range(1, 11)] == [None] * 10
    assert saved == [3, 6, 9, 10]


def test_no_save_without_a_directory(saved):
    run = _run(save="", save_interval=1, max_train_minutes=0.01)
    assert "stopped by --max-train-minutes 0.01 after step 2 of 10" in checkpoints.save_when_due(run, 2, False, 60.0)
    assert saved == []


def test_an_alarm_stops_only_with_stop_on_hacking_and_saves_first(saved):
    assert checkpoints.save_when_due(_run(), 4, alarm=True, elapsed=1.0) is None
    assert saved == []
    run = _run(stop_on_hacking=True)
    assert checkpoints.save_when_due(run, 4, alarm=True, elapsed=1.0) == \
        "megarl: stopped by --stop-on-hacking after step 4 of 10, checkpoint saved in /ckpt"
    assert saved == [4]
    assert run.agreed == [True, False]  # every rank takes part in both agreements, hacking first


def test_past_the_time_limit_it_saves_and_stops_naming_the_flag(saved):
    run = _run(max_train_minutes=0.5)
    assert checkpoints.save_when_due(run, 5, alarm=False, elapsed=29.0) is None
    stop = checkpoints.save_when_due(run, 6, alarm=False, elapsed=31.0)
    assert stop == ("megarl: stopped by --max-train-minutes 0.5 after step 6 of 10: the learning-rate schedule, set "
                    "for all the steps, did not finish")
    assert saved == [6]


def test_hacking_is_named_before_the_time_limit_when_both_stop_the_run(saved):
    run = _run(max_train_minutes=0.5, stop_on_hacking=True)
    assert "--stop-on-hacking" in checkpoints.save_when_due(run, 7, alarm=True, elapsed=31.0)
    assert saved == [7]
