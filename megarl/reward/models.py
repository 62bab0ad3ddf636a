"""Reward models beside the rule verifiers: sources that score (prompt, response, label) rows in batches.

A data row names one in its `verifier` field like any verifier (`"verifier": "hf_rm"`), alone or composed with
rules (`megarl.reward.compose`). Unlike a verifier a reward model sees the prompt, scores a batch at once and
runs in the trainer's process (`megarl.reward.RoutedReward`), never in a reward worker: one resident copy per
trainer, not one per worker.

- `hf_rm`: an HF sequence classifier (`--reward-model DIR`) kept resident in a reward server process, the
  `megarl-serve-rm` this source starts on a free local port on first use (and starts again if it dies); rows go
  to it in batches of `--reward-model-batch-size`.
- `remote_rm`: one HTTP POST per row to `--remote-rm-url`, rows in flight concurrently; a server that fails,
  hangs or answers garbage gives `timeout` / `parse_error` rows after bounded retries (`megarl.reward.http`).
- `llm_judge`: `megarl.reward.judge`.

The protocol `remote_rm` speaks (and `megarl-serve-rm` serves): POST JSON `{"prompt", "response", "label"}`, the
reply `{"score": <number>}` (or a bare number); a batch `{"rows": [{...}, ...]}` gets `{"scores": [...]}`.

A model score's outcome is `correct` when it is above `--reward-model-threshold` (default 0: the sign of a
Bradley-Terry score), else `incorrect`: what accuracy, dynamic sampling and the agreement with a rule read. The
reward is the score itself. Imports neither torch nor megatron.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from megarl.errors import ConfigError
from megarl.registry import Registry, option
from megarl.verifiers.base import VerifyResult
from megarl.reward.http import post_json

Row = tuple[Any, str, Any]  # (prompt: text or chat messages, response, label)


class RewardModel(Protocol):
    """`score(rows)`: one result per row, in order, never an exception for a row's failure."""

    name: str
    restarts: int  # servers restarted so far

    def score(self, rows: Sequence[Row]) -> list[VerifyResult]: ...

    def close(self) -> None: ...


REWARD_MODELS: Registry[Callable[..., RewardModel]] = Registry("reward model", builtins=("megarl.reward.judge",))

# Class decorator, as `register_verifier`: built with the run's options for `name` as keyword arguments.
register_reward_model = REWARD_MODELS.register


def model_result(score: float, threshold: float, seconds: float) -> VerifyResult:
    if not math.isfinite(score):
        return VerifyResult(0.0, "parse_error", normalized=f"score {score} is not a finite number", seconds=seconds)
    return VerifyResult(score, "correct" if score > threshold else "incorrect", normalized=repr(score),
                        seconds=seconds)


def _number(value: Any) -> float | None:
    if isinstance(value, dict):
        value = value.get("score", value.get("reward"))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass
class RemoteOptions:
    remote_rm_url: str = option("", "remote_rm: URL each row is POSTed to as {prompt, response, label}; the reply is "
                                "{score}")
    remote_rm_timeout: float = option(10.0, "remote_rm: seconds an attempt may wait for the server")
    remote_rm_retries: int = option(2, "remote_rm: attempts after the first when the server fails, hangs or answers "
                                    "garbage; then the row is a timeout or parse_error")
    remote_rm_backoff: float = option(0.5, "remote_rm: seconds before the first retry, doubling at each")

    def __post_init__(self):
        if self.remote_rm_timeout <= 0 or self.remote_rm_retries < 0 or self.remote_rm_backoff < 0:
            raise ConfigError(f"--remote-rm-timeout must be > 0, --remote-rm-retries and --remote-rm-backoff >= 0; got "
                              f"{self.remote_rm_timeout}, {self.remote_rm_retries} and {self.remote_rm_backoff}")
        if self.remote_rm_url and not self.remote_rm_url.startswith(("http://", "https://")):
            raise ConfigError(f"--remote-rm-url {self.remote_rm_url!r}: expected an http:// or https:// URL")

    def kwargs(self, cfg) -> dict[str, Any]:
        return dict(url=self.remote_rm_url, timeout_s=self.remote_rm_timeout, retries=self.remote_rm_retries,
                    backoff_s=self.remote_rm_backoff, threshold=cfg.reward.reward_model_threshold)


@register_reward_model("remote_rm", options=RemoteOptions)
class RemoteRewardModel:
    """One POST per row to `url` (see the module docstring), `concurrency` rows in flight."""

    name = "remote_rm"

    def __init__(self, url: str = "", timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.5,
                 concurrency: int = 8, threshold: float = 0.0):
        if not url:
            raise ValueError("rows name remote_rm but --remote-rm-url is not set")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--remote-rm-url {url!r}: expected an http:// or https:// URL")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.threshold, self.restarts = threshold, 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="remote_rm")

    def score(self, rows: Sequence[Row]) -> list[VerifyResult]:
        return list(self._pool.map(self._one, rows))

    def _one(self, row: Row) -> VerifyResult:
        prompt, response, label = row
        reply = post_json(self.url, {"prompt": prompt, "response": response, "label": label}, self.timeout_s,
                          self.retries, self.backoff_s)
        if reply.outcome != "ok":
            return VerifyResult(0.0, reply.outcome, normalized=f"{reply.reason} ({reply.attempts} attempts)",
                                seconds=reply.seconds)
        score = _number(reply.value)
        if score is None:
            return VerifyResult(0.0, "parse_error", normalized=f"{self.url}: no number in the reply "
                                f"{str(reply.value)[:80]!r}", seconds=reply.seconds)
        return model_result(score, self.threshold, reply.seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class HFOptions:
    reward_model: str = option("", "hf_rm: HF sequence-classification checkpoint (one label) scoring the rows that "
                               "name hf_rm, served resident by a megarl-serve-rm this process starts")
    reward_model_batch_size: int = option(16, "hf_rm: rows per request and forward pass; each request may take "
                                          "--reward-timeout seconds")
    reward_model_normalize: bool = option(False, "hf_rm: (score - reward_mean) / reward_std, as stored in the reward "
                                          "model's config.json")

    def __post_init__(self):
        if self.reward_model_batch_size < 1:
            raise ConfigError(f"--reward-model-batch-size must be >= 1, got {self.reward_model_batch_size}")
        if self.reward_model and not Path(self.reward_model, "config.json").is_file():
            raise ConfigError(f"--reward-model {self.reward_model}: no config.json there (an HF sequence-"
                              "classification checkpoint directory is expected)")

    def kwargs(self, cfg) -> dict[str, Any]:
        return dict(model=self.reward_model, batch_size=self.reward_model_batch_size,
                    normalize=self.reward_model_normalize, timeout_s=cfg.reward.reward_timeout,
                    threshold=cfg.reward.reward_model_threshold)


@register_reward_model("hf_rm", options=HFOptions)
class ServedHFRewardModel:
    """`--reward-model DIR` in a `megarl-serve-rm` process this source owns (see the module docstring)."""

    name = "hf_rm"
    start_timeout_s = 300.0  # loading a large reward model from disk takes a while

    def __init__(self, model: str = "", batch_size: int = 16, normalize: bool = False, timeout_s: float = 60.0,
                 threshold: float = 0.0, device: str = "cpu"):
        if not model:
            raise ValueError("rows name hf_rm but --reward-model is not set (an HF sequence-classification "
                             "checkpoint directory)")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"--reward-model {model}: no config.json there (an HF checkpoint directory is expected)")
        self.model, self.batch_size, self.normalize = model, batch_size, normalize
        self.timeout_s, self.threshold, self.device = timeout_s, threshold, device
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self.url = ""

    def _ensure_server(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:  # it died: start another, and count it
            self.restarts += 1
        self._proc, self.url = start_server(
            ["--reward-model", self.model, "--batch-size", str(self.batch_size), "--device", self.device,
             *(["--normalize"] if self.normalize else [])], self.start_timeout_s)

    def score(self, rows: Sequence[Row]) -> list[VerifyResult]:
        self._ensure_server()
        out: list[VerifyResult] = []
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            payload = {"rows": [{"prompt": p, "response": r, "label": lab} for p, r, lab in chunk]}
            reply = post_json(self.url, payload, self.timeout_s, retries=1, backoff_s=0.5)
            each = reply.seconds / len(chunk)
            scores = reply.value.get("scores") if isinstance(reply.value, dict) else None
            if reply.outcome != "ok" or not isinstance(scores, list) or len(scores) != len(chunk):
                why = reply.reason or f"the reward server's reply has no {len(chunk)} scores"
                out.extend(VerifyResult(0.0, reply.outcome if reply.outcome != "ok" else "parse_error",
                                        normalized=why, seconds=each) for _ in chunk)
                continue
            out.extend(model_result(s, self.threshold, each) if _number(s) is not None else
                       VerifyResult(0.0, "parse_error", normalized=f"score {s!r}", seconds=each) for s in scores)
        return out

    def close(self) -> None:
        stop_server(self._proc)
        self._proc = None


def start_server(args: list[str], timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Start `megarl-serve-rm ARGS --port 0` here; (the process, its URL) once it says it listens. A server that
    exits or stays silent past `timeout_s` is stopped and its last output raised in the error."""
    cmd = [sys.executable, "-m", "megarl.cli.serve_rm", *args, "--host", "127.0.0.1", "--port", "0",
           "--exit-with-parent"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip())
            if not found and line.startswith("megarl-serve-rm: listening on "):
                found.append(line.split()[-1])

    reader = threading.Thread(target=read, daemon=True)  # keeps draining, so the server never blocks on a pipe
    reader.start()
    deadline = time.monotonic() + timeout_s
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        stop_server(proc)
        why = "exited" if proc.returncode not in (None, -15, -9) else f"did not start within {timeout_s:g} s"
        raise RuntimeError(f"the reward server ({' '.join(cmd[2:])}) {why}:\n" + "\n".join(lines[-20:]))
    return proc, found[0]


def stop_server(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
