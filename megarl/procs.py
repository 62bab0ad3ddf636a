"""Processes seen from /proc (Linux): whose child each process is, and everything under a process. For what
watches processes it did not start itself or whose grandchildren it does not hold: the fault injection
(`megarl.faults`), the SGLang engine's health probe (`megarl.rollout.sglang_health`), the tests of both. And
`exiting`, the end of a process's life: for train.py's and megarl-eval's `__main__`."""

from __future__ import annotations

import os


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


def descendants(*pids: int) -> list[int]:
    """Every process under `pids` (children, theirs, ...), not `pids` themselves."""
    tree, out, todo = children(), [], list(pids)
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


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
