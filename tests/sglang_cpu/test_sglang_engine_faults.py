"""SGLang's CPU engine in-process (`SGLangEngine`, not colocated) survives its scheduler's death mid-generate: found
within a second, the engine is launched again, given the weights of the last sync (not the checkpoint's: the probe
still matches transformers holding the synced weights) and its version, and the generate in flight is sent again,
answering the tokens of the engine that never failed (greedy decoding, which repeats on CPU). Then it hangs
(SIGSTOP), found once its processes use no CPU for --engine-health-timeout (3 s here), one failure past
--engine-max-restarts 1: the error names the engine and its last error. One launch and one restart
(checks_engine_faults.py), 2 to 3.5 minutes on 2 loaded cores."""

import pytest

pytestmark = pytest.mark.faults


def test_a_killed_then_a_hung_scheduler_is_restarted_with_its_weights_and_the_generate_sent_again(
        worker_for, starter, sglang_python):
    r = worker_for("checks_engine_faults", timeout_s=600).call("restarts", model_dir=str(starter))
    log = r["log"]
    assert r["after_crash"] == r["expected"], "no sample lost or changed"
    assert r["restarts"] == 1 and r["version"] == 1 and r["seconds_lost"] > 0
    assert set(r["restarted_pids"]).isdisjoint(r["first_pids"])
    assert r["gap_before"] < 1e-3 and r["gap_after"] < 1e-3, "the restarted engine holds the synced weights"
    assert "died during the 'generate' call: its process" in log, log[-3000:]
    assert "restarting the engine (restart 1 of 1), with weights version 1" in log, log[-3000:]
    assert r["stopped"] is not None and r["stopped"].startswith(
        "the SGLang engine stopped the run after 1 restart(s) (--engine-max-restarts 1); its last error: the SGLang "
        "engine (scheduler and detokenizer pids "), r
    assert "is hung: the 'generate' call unanswered and no CPU used by its processes for" in r["stopped"], r
    assert 3.0 <= r["hang_s"] < 30, r["hang_s"]
    print(f"SGLang CPU engine: launch {r['launch_s']:.1f} s; killed mid-generate: answered {r['crash_s']:.1f} s "
          f"after (1 s of it stopped before the kill; engine_seconds_lost {r['seconds_lost']:.1f}); hung: the run "
          f"stopped {r['hang_s']:.1f} s after (health timeout 3 s)")
