"""Health of the in-process SGLang engine (`SGLangEngine`) where it runs beside the actor (not colocated: SGLang's
CPU engine). `sglang.Engine` keeps its tokenizer manager in the trainer's process and runs its scheduler and
detokenizer in child processes; a call on it (generate, score, flush) is a request to them, answered over ZMQ.

What goes wrong, and how it is seen from here:
- a child dies (the OOM killer, a crash in a kernel): its pid is gone or a zombie. SGLang's own watchdog then
  sends SIGQUIT to the trainer, whose handler would kill the whole process tree (the trainer and its reward
  workers with it); a watched engine is launched with `sigquit_noted` as SGLang's `custom_sigquit_handler`
  instead, which only notes it, and this module's probe decides.
- a child hangs (deadlocked, stopped, swapped out): the call does not answer and the engine's processes use no
  CPU. A call that has not answered within `health_timeout_s` while none of the processes advanced its CPU time
  over that long counts as hung; a long generate that computes is not hung.

Every call runs on a thread of its own while the caller probes the processes once a second (`EngineWatch.call`),
so a call on a dead or hung engine returns `EngineDeadError` within about a second, or within the health timeout,
instead of waiting forever on a ZMQ socket. Calls are never made from the main thread, so SGLang's tokenizer
manager does not install its running-phase SIGQUIT handler (which would kill the process tree) over the noted one.
The engine's processes are found from outside, as the children this process gained while the engine launched
(`launched`); a restart kills them, every descendant included, and stops the dead engine's event loop so the
thread blocked on it ends. What a restart reloads and sends again is `SGLangEngine`'s business.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Callable

from megarl import procs
from megarl.rollout.engine_process import EngineDeadError, call_restarting

PROBE_S = 1.0  # how often a call's engine processes are looked at


def sigquit_noted(signum=None, frame=None) -> None:
    """SGLang's `custom_sigquit_handler` for a watched engine: a child failed (SGLang's watchdog or a dying
    scheduler says so with SIGQUIT); the probe finds which, and the engine is restarted or the run stopped
    with its name, instead of SGLang killing the trainer's whole process tree."""
    print("megarl: sglang: SIGQUIT from the engine (one of its processes failed): left to megarl's health probe",
          file=sys.stderr, flush=True)


class EngineWatch:
    """The processes of one launched engine (`pids`, each with everything under it), and calls on it, watched.
    `what` names the engine and `processes` its processes in messages (vLLM's CPU engine is watched the same way:
    `megarl.rollout.vllm_engine`)."""

    def __init__(self, pids: list[int], health_timeout_s: float, what: str = "the SGLang engine",
                 processes: str = "scheduler and detokenizer"):
        self.pids, self.health_timeout_s, self.what, self.processes = list(pids), health_timeout_s, what, processes

    @classmethod
    def launched(cls, launch: Callable[[], object], health_timeout_s: float, what: str = "the SGLang engine",
                 processes: str = "scheduler and detokenizer",
                 tag: str = "sglang") -> tuple[object, "EngineWatch | None"]:
        """`launch()` (an `sglang.Engine`, a `vllm.LLM`), and the watch of the processes it started; None, said on
        stderr, for an engine that started none (a stand-in, as the contract tests' fakes): its calls are made
        unwatched, as a colocated engine's are."""
        before = set(procs.children().get(os.getpid(), []))
        engine = launch()
        pids = [p for p in procs.children().get(os.getpid(), []) if p not in before and not _is_helper(p)]
        if not pids:
            print(f"megarl: {tag}: the engine started no process of its own that megarl can watch: its health is "
                  "not probed (--engine-health-timeout does not apply)", file=sys.stderr, flush=True)
            return engine, None
        return engine, cls(pids, health_timeout_s, what, processes)

    def name(self) -> str:
        return f"{self.what} ({self.processes} pids {', '.join(map(str, self.pids))})"

    def dead(self) -> str | None:
        """Why the engine is dead (a process gone, a zombie), or None."""
        for pid in self.pids:
            state = _stat(pid)
            if state is None or state[0] in "ZX":
                return f"its process {pid} is gone" if state is None else f"its process {pid} exited"
        return None

    def cpu_ticks(self) -> int:
        return sum((s[1] if (s := _stat(p)) else 0) for p in self._all())

    def call(self, fn: Callable[[], object], what: str, timeout_s: float):
        """`fn()` (a call on the engine), run on a thread of its own; EngineDeadError when the engine dies or
        hangs meanwhile (module docstring), an EngineDeadError too past `timeout_s`."""
        box: dict = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        worker = threading.Thread(target=run, daemon=True, name="megarl-sglang-call")
        start = last_progress = time.monotonic()
        ticks = self.cpu_ticks()
        worker.start()
        while True:
            worker.join(PROBE_S)
            if not worker.is_alive():
                break
            now = time.monotonic()
            why = self.dead()
            if why is not None:
                raise EngineDeadError(f"{self.name()} died during the {what!r} call: {why}")
            current = self.cpu_ticks()
            if current != ticks:
                ticks, last_progress = current, now
            elif now - last_progress > self.health_timeout_s:
                raise EngineDeadError(f"{self.name()} is hung: the {what!r} call unanswered and no CPU used by its "
                                      f"processes for {now - last_progress:.0f} s (--engine-health-timeout "
                                      f"{self.health_timeout_s:g})")
            if now - start > timeout_s:
                raise EngineDeadError(f"{self.name()} did not answer the {what!r} call within {timeout_s:g} s")
        if "error" in box:  # an engine that died under the call may fail it rather than leave it waiting
            for _ in range(10):
                why = self.dead()
                if why is not None:
                    raise EngineDeadError(f"{self.name()} died during the {what!r} call: {why}") from box["error"]
                time.sleep(PROBE_S / 10)
            raise box["error"]
        return box["value"]

    def kill(self, engine=None) -> None:
        """SIGKILL every process of the engine, and stop its event loop (`engine.loop`), whose `run_until_complete`
        a call's thread may be blocked in: that call then ends with an error nobody waits for."""
        for pid in self._all():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        loop = getattr(engine, "loop", None)
        if isinstance(loop, asyncio.AbstractEventLoop) and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)

    def kill_for_fault(self, hang: bool = False) -> None:
        """MEGARL_FAULT engine_crash (SIGKILL) or engine_hang (SIGSTOP) of the engine's processes."""
        for pid in self._all():
            try:
                os.kill(pid, signal.SIGSTOP if hang else signal.SIGKILL)
            except OSError:
                pass

    def _all(self) -> list[int]:
        return [*self.pids, *procs.descendants(*self.pids)]


class RestartingCalls:
    """The restart-and-resend loop of an in-process engine whose processes an `EngineWatch` watches (SGLang's CPU
    engine, `SGLangEngine`; vLLM's, `VLLMEngine`). The engine sets `watch` (None: calls made directly), `relaunch`
    (a fresh engine and its watch), `max_restarts`, `timeout_s`, `restarts`, `seconds_lost`, `_kept` and
    `_kept_version` (the weights a restarted engine starts with, and their version), and defines `_handle()` (what
    calls are made on) and `_restart()` (the dead engine killed, a fresh one holding the kept weights). `_tag` and
    `_label` name it."""

    _tag, _label = "sglang", "the SGLang engine"

    def _call(self, what: str, call: Callable[[object], object]):
        """`call(engine)`, on a watched engine through its watch (`EngineWatch.call`): restarted when it dies or
        hangs (at most `max_restarts` times in the run, and only with `relaunch`) and the call made again on the
        new one (a weight sync keeps its buckets first, so the new engine starts with them). Unwatched
        (colocated), made directly."""
        if self.watch is None:
            return call(self._handle())
        return call_restarting(
            self, lambda: self.watch.call(lambda: call(self._handle()), what, self.timeout_s), self._label,
            lambda e: (f"megarl: {self._tag}: {e}: restarting the engine (restart {self.restarts} of "
                       f"{self.max_restarts}), with weights version {self._kept_version}; the {what!r} call is "
                       "sent again"),
            lambda: (f"megarl: {self._tag}: the engine was restarted ({self.watch.name()}); engine_restarts "
                     f"{self.restarts}, {self.seconds_lost:.1f} s lost in all"),
            can_restart=self.relaunch is not None)

    def _sync_kept(self, kept, version: int, push: Callable[[object, object], None]) -> None:
        """A weight sync of a watched engine: `kept` (the sync on the CPU) becomes what a restarted engine starts
        with, then `push(engine, kept)` is made through `_call`; after a restart the fresh engine already holds it,
        so nothing is sent twice. A sync that fails for good leaves the previous weights kept."""
        previous = self._kept, self._kept_version
        self._kept, self._kept_version = kept, version
        restarts = self.restarts
        try:
            self._call(f"weight sync to version {version}",
                       lambda engine: None if self.restarts != restarts else push(engine, kept))
        except BaseException:
            self._kept, self._kept_version = previous
            raise


def fresh_event_loop() -> None:
    """A new event loop for this thread, for an engine launched after one whose loop may still be blocked in
    a call's thread (`sglang.Engine` takes the thread's current loop)."""
    asyncio.set_event_loop(asyncio.new_event_loop())


def _is_helper(pid: int) -> bool:
    """multiprocessing's resource tracker, started on first use by whoever needs it: not the engine's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return True


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, utime + stime in ticks) of `pid`, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[11]) + int(fields[12])


