"""`--rollout-function verifiers`: episodes of a verifiers 0.4.0 environment, sampled by the run's engine.

    the run's engine  <-  token endpoint (`TokenServer`, this process, 127.0.0.1)
                               ^  POST /inference/v1/generate: token ids in, token ids + log-probs out
    verifiers process  (the environment `make verifiers-env` builds: `verifiers_worker.py`)
        taskset (--verifiers-taskset) -> null harness, subprocess runtime -> TrainClient -> the endpoint
        -> traces: branches (token_ids, sampled_mask, logprobs) and rewards  ->  a JSON file
    this function: one `Sample` per episode, `params.n` episodes per prompt, group by group

verifiers needs openai>=2.54 and transformers 5.25, which SGLang's pins (openai 2.8.0) and megarl's venv do not
allow, so it runs in its own environment and process, started for each call with a timeout
(`--verifiers-timeout`); megarl imports nothing of it. The verifiers process renders each chat turn with the
checkpoint's tokenizer (its chat template) and posts the ids; the engine's ids come back verbatim, so a sample's
tokens are the sampled ones, never re-encoded text.

Row i of --prompt-data is the taskset's task i (the row's own prompt is not what the model sees: the taskset's
task is; megarl's reward function is not called: the reward is the trace's, the sum of its weighted rewards).
A sample is the episode's branch: its tokens before the first sampled one are the prompt, the rest the response
with `loss_mask` = the trace's sampled mask and the trace's log-probs (0 where not sampled). An episode with
several branches (a turn whose prompt the trace could not prove to extend the previous one) keeps its last
branch, the one that ends in the reply the reward judged, and reports the others dropped
(`sample_verifiers_branches_dropped`): a GRPO group is `params.n` samples, one per episode. An episode that
failed (an error in the environment, no sampled token) is a `FAILED` sample out of the loss, reward 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from megarl.data import PromptRecord
from megarl.errors import ConfigError
from megarl.reward import RewardFn
from megarl.rollout.base import RolloutEngine, SamplingParams
from megarl.rollout.functions import Rollout, register_rollout
from megarl.rollout.slots import ROLLOUTS, VerifiersOptions
from megarl.rollout.token_server import TokenServer
from megarl.samples import Sample, SampleStatus

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("verifiers_worker.py")


def verifiers_python(env_dir: str = "") -> Path:
    """The verifiers environment's interpreter: `env_dir`, else $MEGARL_VERIFIERS_ENV, else .cache/verifiers-env;
    a `ConfigError` saying how to build it when it is not there."""
    root = Path(env_dir or os.environ.get("MEGARL_VERIFIERS_ENV") or REPO / ".cache" / "verifiers-env")
    python = root / "bin" / "python"
    if not (root / ".megarl-stamp").is_file() or not python.exists():
        raise ConfigError(f"--rollout-function verifiers: no verifiers environment at {root} (--verifiers-env, "
                          "$MEGARL_VERIFIERS_ENV); build it with `make verifiers-env`")
    return python


def episode_sample(group: int, record: PromptRecord, episode: dict, version: int, tokenizer,
                   correct_at: float) -> Sample:
    """One episode of the verifiers process's answer as a `Sample` (see the module docstring)."""
    branches = episode["branches"]
    sampled = [b for b in branches if any(b["sampled_mask"])]
    metadata = {"verifiers_branches_dropped": float(max(len(sampled) - 1, 0)),
                "verifiers_failed": float(not sampled or not episode["ok"])}
    if not sampled:
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return Sample(group=group, prompt_index=record.index, prompt_ids=list(record.prompt_ids), response_ids=[eos],
                      loss_mask=[0], rollout_logprobs=[0.0], weight_version=version, status=SampleStatus.FAILED,
                      response_text="; ".join(episode["errors"])[:500], reward=0.0, outcome="no_answer",
                      metadata=metadata)
    branch = sampled[-1]
    ids, mask, logp = branch["token_ids"], branch["sampled_mask"], branch["logprobs"]
    if not len(ids) == len(mask) == len(logp):
        raise RuntimeError(f"a verifiers branch of task {episode['task']} has {len(ids)} tokens, {len(mask)} mask "
                           f"entries and {len(logp)} log-probs")
    start = mask.index(True)
    response = ids[start:]
    reward = float(episode["reward"])
    return Sample(group=group, prompt_index=record.index, prompt_ids=ids[:start], response_ids=response,
                  loss_mask=[int(m) for m in mask[start:]],
                  rollout_logprobs=[float(lp) if m else 0.0 for lp, m in zip(logp[start:], mask[start:])],
                  weight_version=version,
                  status=SampleStatus.TRUNCATED if episode["truncated"] else SampleStatus.COMPLETED,
                  response_text=tokenizer.decode(response, skip_special_tokens=True), reward=reward,
                  outcome="correct" if reward >= correct_at else "incorrect", metadata=metadata)


class VerifiersRollout(Rollout):
    """The `verifiers` rollout function with its settings (`VerifiersOptions`) and the run's tokenizer directory
    (the verifiers process renders chats with it)."""

    def __init__(self, options: VerifiersOptions, tokenizer_dir: str, max_prompt_len: int = 0):
        if not options.verifiers_taskset:
            raise ConfigError("--rollout-function verifiers needs --verifiers-taskset")
        self.options, self.tokenizer_dir, self.max_prompt_len = options, tokenizer_dir, max_prompt_len
        self.python = verifiers_python(options.verifiers_env)
        self.last: dict[str, float] = {}

    def __call__(self, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                 reward: RewardFn, tokenizer) -> list[Sample]:
        o = self.options
        version = engine.weight_version
        server = TokenServer(engine, vocab_size=len(tokenizer), max_tokens_cap=params.max_new_tokens,
                             batch_window=o.verifiers_batch_window, request_timeout=o.verifiers_timeout,
                             max_model_len=(self.max_prompt_len + params.max_new_tokens) if self.max_prompt_len
                             else None)
        request = {"taskset": o.verifiers_taskset, "tasks": [p.index for p in prompts], "n": params.n,
                   "base_url": server.url, "model": server.model_name, "tokenizer": self.tokenizer_dir,
                   "sampling": {"temperature": params.temperature, "top_p": params.top_p,
                                "max_tokens": params.max_new_tokens},
                   "max_turns": o.verifiers_max_turns or None, "concurrency": o.verifiers_concurrency}
        try:
            with tempfile.TemporaryDirectory(prefix="megarl-verifiers-") as home:
                answer = self._run_worker(request, home)
        finally:
            server.close()
        episodes = answer["episodes"]
        if len(episodes) != len(prompts) * params.n:
            raise RuntimeError(f"the verifiers process answered {len(episodes)} episodes for {len(prompts)} "
                               f"prompts x {params.n}")
        samples = [episode_sample(i // params.n, prompts[i // params.n], ep, version, tokenizer, o.verifiers_correct_at)
                   for i, ep in enumerate(episodes)]
        self.last = {"verifiers_engine_calls": float(server.engine_calls),
                     "verifiers_requests_per_call": sum(server.batches) / max(len(server.batches), 1)}
        return samples

    def _run_worker(self, request: dict, home: str) -> dict:
        """The verifiers process over `request`: its own HOME (verifiers keeps its caches and the subprocess
        runtime's working directories under ~/.cache), killed after --verifiers-timeout."""
        env = {**os.environ, "HOME": home, "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in self.options.verifiers_path.split(":") if p)
        request = {**request, "answer_path": str(Path(home) / "answer.json")}
        try:
            proc = subprocess.run([str(self.python), str(WORKER)], input=json.dumps(request), capture_output=True,
                                  text=True, env=env, timeout=self.options.verifiers_timeout, cwd=home)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"--rollout-function verifiers: the verifiers process took longer than "
                               f"--verifiers-timeout {self.options.verifiers_timeout:g} s; its stderr's end:\n"
                               f"{(e.stderr or b'')[-3000:]!s}") from None
        answer = Path(request["answer_path"])
        if proc.returncode != 0 or not answer.is_file():
            raise RuntimeError(f"--rollout-function verifiers: the verifiers process (taskset "
                               f"{self.options.verifiers_taskset!r}) exited with {proc.returncode}; its stderr's "
                               f"end:\n{proc.stderr[-3000:]}")
        return json.loads(answer.read_text())

    def step_metrics(self) -> dict[str, float]:
        return dict(self.last)


def _configure(cfg) -> VerifiersRollout:
    return VerifiersRollout(ROLLOUTS.settings(cfg, "verifiers"), cfg.model.hf_checkpoint,
                            cfg.data.max_prompt_len)


@register_rollout("verifiers", configure=_configure)
def verifiers(engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams, reward: RewardFn,
              tokenizer) -> list[Sample]:
    """Episodes of a verifiers environment; the trainer builds it from the run's flags (`configure`), and a call
    without them has no taskset to run."""
    raise ConfigError("--rollout-function verifiers is built from the run's flags (--verifiers-taskset ...): call "
                      "ROLLOUTS.get('verifiers').configure(cfg)")
