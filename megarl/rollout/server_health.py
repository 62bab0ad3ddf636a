"""Health of rollout servers reached over HTTP (`--rollout-servers`): which are up, and where a request goes when
the server it was sent to dies or hangs.

While a request runs on a server, the server's `/health` is asked every `probe_s` seconds, each answer awaited at
most `health_timeout_s` (`--engine-health-timeout`). A server is down when a request to it fails at the connection
(refused, reset, closed mid-answer: the process died), answers 502/503/504, or does not answer its `/health` in
time (hung). A down server is named on stderr and its request goes to the next server that is up; with none up,
the request waits for any server to answer `/health` again, for at most `RETURN_TIMEOUTS` x `health_timeout_s`,
and is sent there.
Sampling is seeded per request, so a request sent again gets the samples the lost one would have had: none lost,
none counted twice. Each server failure counts; past `max_restarts` (`--engine-max-restarts`, 0: the first
failure stops the run) the run stops with `ServerDeadError` naming the server and its last error.

A down server takes no more requests while another is up: a server that was relaunched (not merely paused) holds
its launch weights and has left the weight-update group, and nothing here can tell the two apart; the pause case
is the one "answers again" covers. The weight syncs are not failed over: a server that dies during one fails it.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Sequence


class ServerDeadError(RuntimeError):
    """A rollout server died or hung, and the run may not tolerate more failures (or none is left to answer)."""


class ServerDown(Exception):
    """One server is down: `url` and why."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{url}: {why}")
        self.url, self.why = url, why


# What a request to a dead server raises (refused, reset, closed mid-answer, timed out), and the HTTP statuses of a
# server that cannot serve (a gateway in front of a dead one; SGLang while it is unhealthy)
CONNECTION_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException, OSError)
DOWN_STATUSES = (502, 503, 504)
RETURN_TIMEOUTS = 5  # with every server down, how many health timeouts a request waits for one to answer again


class ServerHealth:
    """Which of `urls` are up, and `call`: a request run on one, sent again elsewhere when that one goes down."""

    def __init__(self, urls: Sequence[str], health_timeout_s: float = 60.0, max_restarts: int = 0,
                 probe_s: float | None = None, what: str = "SGLang server"):
        self.urls = list(urls)
        self.health_timeout_s, self.max_restarts, self.what = health_timeout_s, max_restarts, what
        self.probe_s = probe_s if probe_s is not None else min(5.0, health_timeout_s / 2)
        self.down: dict[str, str] = {}  # url -> its last error
        self.restarts = 0  # server failures recovered from (the requests sent again): `engine_restarts`
        # wall time during which a request was held up by a failure: from its first sign to the answer of the
        # request sent again, counted once however many requests were held up together
        self.seconds_lost = 0.0
        self._held_up, self._held_since = 0, 0.0
        self._lock = threading.Lock()

    def probe(self, url: str, timeout: float | None = None) -> None:
        """Raise `ServerDown` unless `url`'s `/health` answers 200 within `timeout` (default `health_timeout_s`)."""
        timeout = self.health_timeout_s if timeout is None else timeout
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            raise ServerDown(url, f"/health answered HTTP {e.code}") from None
        except CONNECTION_ERRORS as e:
            why = "no answer to /health" if _timed_out(e) else f"/health failed: {type(e).__name__}: {e}"
            raise ServerDown(url, f"{why} within {timeout:g} s (--engine-health-timeout)") from None

    def call(self, url: str, request: Callable[[str], object], refused: Callable[[BaseException], int | None]):
        """`request(url)`, watched: sent again to another server (or to this one once it answers again) when `url`
        goes down. `refused(e)` is the HTTP status of an error answer (None: not one)."""
        held_up = False
        try:
            while True:
                try:
                    return self._watched(url, request, refused)
                except ServerDown as e:
                    if not held_up:
                        held_up = True
                        with self._lock:
                            self._held_up += 1
                            if self._held_up == 1:
                                self._held_since = time.monotonic()
                    url = self._failed(e)
        finally:
            if held_up:
                with self._lock:
                    self._held_up -= 1
                    if self._held_up == 0:
                        self.seconds_lost += time.monotonic() - self._held_since

    def _watched(self, url: str, request: Callable[[str], object], refused) -> object:
        if url in self.down:
            url = self._next_up(url)
        box: dict = {}

        def run():
            try:
                box["value"] = request(url)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        worker = threading.Thread(target=run, daemon=True)  # abandoned, still blocked, if its server hangs
        worker.start()
        while True:
            worker.join(self.probe_s)
            if not worker.is_alive():
                break
            try:
                self.probe(url)
            except ServerDown:
                if worker.is_alive():
                    raise
        if "error" in box:
            e = box["error"]
            status = refused(e)
            if status in DOWN_STATUSES or (status is None and isinstance(e, CONNECTION_ERRORS)):
                raise ServerDown(url, f"{type(e).__name__}: {e}") from e
            raise e
        return box["value"]

    def _failed(self, e: ServerDown) -> str:
        """Count a failure of `e.url`: the server its request goes to next; ServerDeadError past the limit."""
        with self._lock:
            if e.url not in self.down:  # one failure, however many requests were in flight on it
                if self.restarts >= self.max_restarts:
                    raise ServerDeadError(
                        f"{self.what} {e.url} stopped the run after {self.restarts} server failure(s) "
                        f"(--engine-max-restarts {self.max_restarts}); its last error: {e.why}") from None
                self.restarts += 1
                self.down[e.url] = e.why
        nxt = self._next_up(e.url)
        print(f"megarl: {self.what} {e.url} is down ({e.why}): its request goes to {nxt} (server failure "
              f"{self.restarts} of --engine-max-restarts {self.max_restarts})", file=sys.stderr, flush=True)
        return nxt

    def _next_up(self, url: str) -> str:
        """The first server after `url` that is up; with none up, the first to answer `/health` again within
        `RETURN_TIMEOUTS` x `health_timeout_s` (ServerDeadError naming every server otherwise)."""
        i = self.urls.index(url)
        for u in self.urls[i + 1:] + self.urls[: i + 1]:
            if u not in self.down:
                return u
        wait_s = RETURN_TIMEOUTS * self.health_timeout_s
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for u in self.urls:
                try:
                    self.probe(u, timeout=min(1.0, self.health_timeout_s))
                except ServerDown:
                    continue
                with self._lock:
                    self.down.pop(u, None)
                print(f"megarl: {self.what} {u} answers /health again: requests go to it", file=sys.stderr,
                      flush=True)
                return u
            time.sleep(min(1.0, self.health_timeout_s / 10))
        errors = "; ".join(f"{u}: {why}" for u, why in self.down.items())
        raise ServerDeadError(f"every {self.what} is down and none answered /health again within {wait_s:g} s "
                              f"({RETURN_TIMEOUTS} x --engine-health-timeout): {errors}")


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


class WatchedServers:
    """What servers watched by `self.health` (a `ServerHealth`) report in the row: `engine_restarts` and
    `engine_seconds_lost` (`megarl.faults.engine_health`)."""

    health: ServerHealth

    @property
    def restarts(self) -> int:
        """Server failures recovered from so far."""
        return self.health.restarts

    @property
    def seconds_lost(self) -> float:
        return self.health.seconds_lost

