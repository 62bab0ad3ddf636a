"""Processes seen from /proc (Linux): whose child each process is, and everything under a process. For what
watches processes it did not start itself or whose grandchildren it does not hold: the fault injection
(`megarl.faults`), the SGLang engine's health probe (`megarl.rollout.sglang_health`), the tests of both.
`stop_with_agent`: a torchrun worker ends when its agent does. And `exiting`, the end of a process's life: for
train.py's and megarl-eval's `__main__`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def children() -> dict[int, list[int]]:
    """pid -> the pids whose parent it is, read now (a process that ends meanwhile is left out)."""
    out: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the command name, which may hold ")"
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(p))
    return out


def running(pid: int) -> bool:
    """`pid` exists and is not a zombie (dead, waiting for its parent, or init, to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state, after the command name
    except (OSError, IndexError):
        return False


def descendants(*pids: int) -> list[int]:
    """Every process under `pids` (children, theirs, ...), not `pids` themselves."""
    tree, out, todo = children(), [], list(pids)
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


_watching: list[int] = []  # the parent this process's agent watch was started for


def stop_with_agent(interval_s: float = 0.5) -> bool:
    """Under torchrun (TORCHELASTIC_RUN_ID set), a daemon thread that ends this worker (SIGKILL) once its parent,
    the torchrun agent, is gone. torchrun starts each worker in a session of its own, so a SIGKILLed agent (`kill -9`
    of the torchrun pid, the OOM killer) left its workers training on and saving under --save as orphans (three
    more steps and checkpoints within a second of the agent's death, measured), while a run started again read the
    same directory: its ranks resumed from different steps. The worker says why on stderr and ends within
    `interval_s` of its agent, with every process it started; a save cut short stays an `iter_N.tmp`, skipped on
    resume. Once a process; True when the watch runs (False: not under torchrun, or already watching)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or _watching:
        return False
    parent = os.getppid()
    _watching.append(parent)
    rank = os.environ.get("RANK", "?")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(f"megarl: rank {rank}: its torchrun agent (pid {parent}) is gone: this worker stops now, so that no "
              "orphan trains on or writes under --save; the last complete checkpoint is left as it is",
              file=sys.stderr, flush=True)
        # and everything it started: a child blocked on a lock this process held would wait forever (megatron-core's
        # checkpoint writers, forked mid-save, were found stuck in a JoinableQueue's task_done 20 minutes after)
        for pid in [*descendants(os.getpid()), os.getpid()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    threading.Thread(target=watch, name="megarl-agent-watch", daemon=True).start()
    return True


def exiting(code: int) -> int:
    """`code`, with the interpreter's final garbage collection made cheap: for the end of a process that imported
    torch and megatron-core, once its run is over and closed (logs, engines, workers and process groups closed by
    the caller). Their hundreds of thousands of objects made the collections that Python runs at exit take ~1 s of
    every such process (1.3 s -> 0.25 s from main's return to the process's end, measured on a training run).
    `gc.freeze()` leaves them out of those collections; objects are still freed by their reference counts and exit
    handlers still run (objects alive at exit were never promised a `__del__`)."""
    import gc

    gc.freeze()
    return code
