"""The in-process SGLang CPU engine's health (`SGLangEngine` with `megarl.rollout.sglang_health`) against SGLang
0.5.23 itself: its scheduler killed mid-generate (restarted), then stopped (found hung, one restart more than the
run allows). Run by worker.py in the SGLang environment; test_sglang_engine_faults.py says what it proves."""

import contextlib
import io
import os
import signal
import threading
import time

import torch
from checks_engine import STATE, _perturbed, _prompts, _ref_logp

from megarl.rollout import weight_sync
from megarl.rollout.base import SamplingParams
from megarl.rollout.engine_process import EngineDeadError
from megarl.rollout.sglang_engine import SGLangEngine

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def _tokens(groups) -> list:
    return [[c.token_ids for c in g] for g in groups]


def _probe_gap(engine) -> float:
    """The largest |engine - transformers| log-prob of a probe sequence, transformers holding the synced weights."""
    probe = weight_sync.probe_sequence(80, length=32, seed=5)
    engine_logp = torch.tensor(engine.score([probe], [1], temperature=1.0)[0])
    ref = _ref_logp(probe).gather(1, torch.tensor(probe[1:])[:, None])[:, 0]
    return float((engine_logp - ref).abs().max())


def check_restarts(model_dir: str, health_timeout_s: float = 3.0) -> dict:
    STATE["model_dir"] = model_dir
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        t0 = time.monotonic()
        engine = STATE["engine"] = SGLangEngine.launch(
            model_dir, device="cpu", dtype="float32", seed=1234, mem_fraction=0.05, max_running_requests=16,
            health_timeout_s=health_timeout_s, max_restarts=1)
        launch_s = time.monotonic() - t0
        # weights that are not the checkpoint's: a restart that forgot them would generate and score otherwise
        weight_sync.push(engine, iter(_perturbed(1.05)), 1, 256 << 10)
        engine.resume_memory()
        expected, gap_before = _tokens(engine.generate(_prompts(), GREEDY)), _probe_gap(engine)
        first_pids = list(engine.watch.pids)

        # 1. killed mid-generate: stopped first, so the request is surely in flight when SIGKILL comes
        engine.watch.kill_for_fault(hang=True)
        killer = threading.Timer(1.0, lambda: [os.kill(p, signal.SIGKILL) for p in first_pids])
        killer.start()
        t0 = time.monotonic()
        after_crash = _tokens(engine.generate(_prompts(), GREEDY))
        crash_s = time.monotonic() - t0
        killer.join()
        restarted_pids = list(engine.watch.pids)
        gap_after = _probe_gap(engine)
        restarts, seconds_lost, version = engine.restarts, engine.seconds_lost, engine.weight_version

        # 2. hung (SIGSTOP, as `MEGARL_FAULT=engine_hang`), found once its processes use no CPU for the timeout;
        # past --engine-max-restarts: the run stops naming the engine and its last error
        engine.kill_for_fault(hang=True)
        t0 = time.monotonic()
        try:
            engine.generate(_prompts(), GREEDY)
            stopped = None
        except EngineDeadError as e:
            stopped = str(e)
        hang_s = time.monotonic() - t0
    return {"expected": expected, "after_crash": after_crash, "restarts": restarts,
            "version": version, "seconds_lost": seconds_lost, "launch_s": launch_s, "crash_s": crash_s,
            "hang_s": hang_s, "gap_before": gap_before, "gap_after": gap_after, "first_pids": first_pids,
            "restarted_pids": restarted_pids, "stopped": stopped, "log": log.getvalue()}


def close() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()
