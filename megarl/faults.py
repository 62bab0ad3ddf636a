"""Fault injection, for the tests that prove a run survives faults (`tests/faults/`), and for anyone who wants to
see it: `MEGARL_FAULT=name@step[:rank][,name@step[:rank]...]` injects each named fault once, at that step, on that
rank (default: rank 0), and says so on stderr (`megarl: fault injected: <name> at step <step> on rank <rank>`).

A fault fires in the first attempt of a run only (torchrun's `TORCHELASTIC_RESTART_COUNT` is 0 or unset), so the
workers an elastic torchrun restarts after it run on unharmed, as they would after a real fault.

Faults (`FAULTS`):
  trainer_sigkill     the rank kills itself with SIGKILL after the step (and its checkpoint, if one is due)
  kill_during_save    the rank kills itself with SIGKILL in the step's checkpoint save, after every rank wrote its
                      files and before the checkpoint is published (the rename)
  disk_full_on_save   the step's checkpoint save fails on the rank with ENOSPC, as on a full disk
  slow_node           the rank sleeps MEGARL_FAULT_SLOW_S seconds (default 5) before the step: the others wait
  engine_crash        the built-in engine's process (--async-staleness >= 1) is killed with SIGKILL before the
                      step's generation
  engine_hang         the built-in engine's process is stopped with SIGSTOP before the step's generation
  reward_worker_crash a reward worker (--reward-workers >= 1) kills itself with SIGKILL while it scores the first
                      sample the pool takes up after the fault fired (a sample of the step), after verifying it and
                      before answering: the pool replaces it and scores the sample again (`megarl.reward.pool`)
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from functools import lru_cache

from megarl.errors import ConfigError

ENV = "MEGARL_FAULT"
FAULTS = ("trainer_sigkill", "kill_during_save", "disk_full_on_save", "slow_node", "engine_crash", "engine_hang",
          "reward_worker_crash")
_ARMED: set[str] = set()  # faults fired at this step that a component of this process carries out when it gets there


@lru_cache(maxsize=None)
def _parse(spec: str) -> dict[tuple[str, int], int]:
    """name@step[:rank],... -> {(name, step): rank}; a ConfigError naming the variable and the allowed names."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if name not in FAULTS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ConfigError(f"{ENV}={spec!r}: {item!r} is not name@step[:rank] with a name among "
                              f"{', '.join(FAULTS)}")
        out[(name, int(step))] = int(rank or 0)
    return out


def check() -> None:
    """Raise a ConfigError for a malformed MEGARL_FAULT (the run checks it before any work)."""
    _parse(os.environ.get(ENV, ""))


def due(name: str, step: int, rank: int | None = None) -> bool:
    """Whether fault `name` is to fire now, at `step` on this rank (`rank`: default the RANK variable)."""
    spec = os.environ.get(ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return _parse(spec).get((name, step)) == rank


def announce(name: str, step: int) -> None:
    print(f"megarl: fault injected: {name} at step {step} on rank {os.environ.get('RANK', '0')}",
          file=sys.stderr, flush=True)


def fire(name: str, step: int) -> bool:
    """Inject `name` at `step` if it is due here: the faults this module can cause by itself; True when it fired
    (for the faults the caller carries out)."""
    if not due(name, step):
        return False
    announce(name, step)
    if name in ("trainer_sigkill", "kill_during_save"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif name == "disk_full_on_save":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (injected by MEGARL_FAULT)")
    elif name == "slow_node":
        time.sleep(float(os.environ.get("MEGARL_FAULT_SLOW_S", "5")))
    elif name == "reward_worker_crash":
        _ARMED.add(name)  # the reward pool of this process takes it on its next sample (`take`)
    return True


def take(name: str) -> bool:
    """Whether fault `name` was fired and not yet carried out; True once only (for the component that carries it
    out, e.g. the reward pool for reward_worker_crash)."""
    try:
        _ARMED.remove(name)  # atomic: of several threads asking at once, one gets it
    except KeyError:
        return False
    return True


def break_engine(engine, name: str) -> None:
    """engine_crash / engine_hang on the built-in engine's own process, wherever `engine` wraps it."""
    while not hasattr(engine, "kill_for_fault"):
        if not hasattr(engine, "inner"):
            raise ConfigError(f"{ENV}: {name} needs the built-in engine in a process of its own (--rollout-backend "
                              "builtin with --async-staleness >= 1)")
        engine = engine.inner
    engine.kill_for_fault(hang=name == "engine_hang")


def engine_health(engine) -> dict:
    """engine_restarts and engine_seconds_lost, once the engine's process has been restarted ({} before)."""
    while engine is not None and not hasattr(engine, "restarts"):
        engine = getattr(engine, "inner", None)
    if engine is None or not engine.restarts:
        return {}
    return {"engine_restarts": engine.restarts, "engine_seconds_lost": engine.seconds_lost}
