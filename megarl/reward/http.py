"""JSON over HTTP for remote reward sources: one POST with a timeout, bounded retries and backoff, and every failure
mapped onto a reward outcome instead of an exception.

    reply = post_json(url, {"prompt": ..., "response": ..., "label": ...}, timeout_s=10, retries=2, backoff_s=0.5)
    reply.value          # the decoded JSON, or None when every attempt failed
    reply.outcome        # "ok", "timeout" (the last attempt timed out) or "parse_error" (anything else)

What is retried: a connection error, a timeout, an HTTP 5xx or 429, and a reply that is not JSON (a server in the
middle of a restart sends all of these); attempt k + 1 waits `backoff_s * 2**k` first. What is not: any other 4xx
(the server refuses this request and will again). `timeout_s` bounds each blocking socket operation (connect,
each read), so a server that accepts and then says nothing is cut off after `timeout_s`; the whole call is bounded
by (retries + 1) attempts. Standard library only: reward workers and `megarl-verify` stay light.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    value: Any
    outcome: str  # "ok", "timeout" or "parse_error"
    reason: str = ""  # why it failed, for the result's `normalized`
    attempts: int = 1
    seconds: float = 0.0


def post_json(url: str, payload: Any, timeout_s: float, retries: int = 2, backoff_s: float = 0.5,
              headers: dict[str, str] | None = None) -> Reply:
    start = time.perf_counter()
    data = json.dumps(payload).encode()
    outcome, reason = "parse_error", ""
    attempt = 0
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            outcome, reason = "parse_error", f"HTTP {e.code} from {url}"
            if 400 <= e.code < 500 and e.code != 429:
                break
            continue
        except (TimeoutError, socket.timeout):
            outcome, reason = "timeout", f"no reply from {url} within {timeout_s:g} s"
            continue
        except urllib.error.URLError as e:
            timed_out = isinstance(e.reason, (TimeoutError, socket.timeout))
            outcome = "timeout" if timed_out else "parse_error"
            reason = f"no reply from {url} within {timeout_s:g} s" if timed_out else f"{url}: {e.reason}"
            continue
        except (ConnectionError, OSError) as e:  # reset mid-reply, a closed socket
            outcome, reason = "parse_error", f"{url}: {type(e).__name__}: {e}"
            continue
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            outcome, reason = "parse_error", f"{url} sent a reply that is not JSON ({e}): {body[:80]!r}"
            continue
        return Reply(value, "ok", "", attempt + 1, time.perf_counter() - start)
    return Reply(None, outcome, reason, attempt + 1, time.perf_counter() - start)
