"""`llm_judge`: a generative reward model - a judge LLM asked, through a prompt template, to grade each response.

    --judge-url http://host:8000/v1 --judge-model NAME        # any OpenAI-compatible chat-completions endpoint
    --judge-checkpoint DIR                                     # or a local HF causal LM on megarl's built-in engine

The judge sees `--judge-template` with `{prompt}`, `{response}` and `{label}` filled in, as one user message, and
answers greedily (temperature 0, at most `--judge-max-tokens` tokens). `--judge-pattern`, a regular expression
with one group, finds the grade in the answer (the first match); the reward is that number divided by
`--judge-scale` (default: "Score: 7" -> 0.7). An answer without a match, or with a number that is not finite, is a
`parse_error` row with the judge's text in `normalized`; an endpoint that fails, hangs or answers garbage gives
`timeout` / `parse_error` rows after the retries of `megarl.reward.http` (`--remote-rm-timeout`, `-retries`,
`-backoff`). With `--judge-checkpoint` this source starts `megarl-serve-rm --judge-checkpoint DIR` (an OpenAI-
compatible server on a free local port, the model loaded once) and talks to it the same way.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from megarl.errors import ConfigError
from megarl.registry import option
from megarl.reward.http import post_json
from megarl.reward.models import RemoteOptions, Row, model_result, register_reward_model, start_server, stop_server
from megarl.verifiers.base import VerifyResult

DEFAULT_TEMPLATE = ("Grade the response to the question from 0 to 10.\nQuestion: {prompt}\nReference answer: "
                    "{label}\nResponse: {response}\nReply with 'Score: N'.")
DEFAULT_PATTERN = r"[Ss]core\s*[:=]?\s*(-?\d+(?:\.\d+)?)"


@dataclass
class JudgeOptions:
    """The judge's flags; the endpoint's timeout and retries are remote_rm's (`--remote-rm-timeout`, ...)."""

    judge_url: str = option("", "llm_judge: an OpenAI-compatible endpoint (http://host:port/v1) grading the rows that "
                            "name llm_judge (the --remote-rm-timeout/-retries/-backoff apply)")
    judge_model: str = option("", "llm_judge: the model name sent to --judge-url")
    judge_checkpoint: str = option("", "llm_judge: a local HF causal LM to judge with instead of --judge-url, served "
                                   "by a megarl-serve-rm this process starts (the built-in engine)")
    judge_template: str = option("", "llm_judge: the judge's prompt, with {prompt}, {response} and {label} filled in; "
                                 "empty = a 0-10 grading prompt asking for 'Score: N'")
    judge_pattern: str = option("", "llm_judge: regular expression with one group, the grade in the judge's answer; "
                                "empty = 'Score: N'; no match = parse_error")
    judge_scale: float = option(10.0, "llm_judge: the reward is the grade divided by this")
    judge_max_tokens: int = option(32, "llm_judge: longest answer the judge may give (greedy)")

    def __post_init__(self):
        if self.judge_max_tokens < 1:
            raise ConfigError(f"--judge-max-tokens must be >= 1, got {self.judge_max_tokens}")
        if self.judge_scale == 0:
            raise ConfigError("--judge-scale must not be 0 (the reward is the grade divided by it)")

    def kwargs(self, cfg) -> dict[str, Any]:
        remote = cfg.components.get("reward_model.remote_rm") or RemoteOptions()
        return dict(url=self.judge_url, model=self.judge_model, checkpoint=self.judge_checkpoint,
                    scale=self.judge_scale, max_tokens=self.judge_max_tokens, timeout_s=remote.remote_rm_timeout,
                    retries=remote.remote_rm_retries, backoff_s=remote.remote_rm_backoff,
                    threshold=cfg.reward.reward_model_threshold,
                    **({"template": self.judge_template} if self.judge_template else {}),
                    **({"pattern": self.judge_pattern} if self.judge_pattern else {}))


@register_reward_model("llm_judge", options=JudgeOptions)
class LLMJudge:
    name = "llm_judge"

    def __init__(self, url: str = "", model: str = "", checkpoint: str = "", template: str = DEFAULT_TEMPLATE,
                 pattern: str = DEFAULT_PATTERN, scale: float = 10.0, max_tokens: int = 32, timeout_s: float = 30.0,
                 retries: int = 2, backoff_s: float = 0.5, concurrency: int = 8, threshold: float = 0.5):
        if bool(url) == bool(checkpoint):
            raise ValueError("rows name llm_judge: set exactly one of --judge-url (an OpenAI-compatible endpoint) "
                             "and --judge-checkpoint (a local HF causal LM)")
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"--judge-url {url!r}: expected an http:// or https:// URL")
        try:
            template.format(prompt="", response="", label="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"--judge-template: only {{prompt}}, {{response}} and {{label}} may be filled in "
                             f"({type(e).__name__}: {e})") from None
        try:
            self.pattern = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"--judge-pattern {pattern!r}: not a regular expression ({e})") from None
        if self.pattern.groups != 1:
            raise ValueError(f"--judge-pattern {pattern!r}: needs exactly one group, the grade")
        if scale == 0:
            raise ValueError("--judge-scale must not be 0")
        self.base, self.model, self.checkpoint = url.rstrip("/"), model, checkpoint
        self.template, self.scale, self.max_tokens, self.threshold = template, scale, max_tokens, threshold
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.restarts = 0
        self._proc = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="llm_judge")

    def _ensure_server(self) -> None:
        if not self.checkpoint or (self._proc is not None and self._proc.poll() is None):
            return
        if self._proc is not None:
            self.restarts += 1
        self._proc, url = start_server(["--judge-checkpoint", self.checkpoint], 300.0)
        self.base = url.rstrip("/") + "/v1"

    def score(self, rows: Sequence[Row]) -> list[VerifyResult]:
        self._ensure_server()
        return list(self._pool.map(self._one, rows))

    def _one(self, row: Row) -> VerifyResult:
        prompt, response, label = row
        if isinstance(prompt, list):  # a chat: the judge reads its messages' text
            prompt = "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
        text = self.template.format(prompt=prompt, response=response, label="" if label is None else label)
        payload = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                   "max_tokens": self.max_tokens}
        reply = post_json(self.base + "/chat/completions", payload, self.timeout_s, self.retries, self.backoff_s)
        if reply.outcome != "ok":
            return VerifyResult(0.0, reply.outcome, normalized=f"{reply.reason} ({reply.attempts} attempts)",
                                seconds=reply.seconds)
        try:
            answer = reply.value["choices"][0]["message"]["content"]
            assert isinstance(answer, str)
        except (KeyError, IndexError, TypeError, AssertionError):
            return VerifyResult(0.0, "parse_error", normalized=f"not a chat completion: {str(reply.value)[:80]!r}",
                                seconds=reply.seconds)
        match = self.pattern.search(answer)
        if match is None:
            return VerifyResult(0.0, "parse_error", normalized=f"no grade in the judge's answer {answer[:80]!r}",
                                seconds=reply.seconds)
        try:
            grade = float(match.group(1))
        except ValueError:
            return VerifyResult(0.0, "parse_error", normalized=f"grade {match.group(1)!r} is not a number",
                                seconds=reply.seconds)
        result = model_result(grade / self.scale, self.threshold, reply.seconds)
        result.extracted = match.group(1)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        stop_server(self._proc)
        self._proc = None
