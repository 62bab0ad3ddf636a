"""`--rollout-function tool_use`: multi-turn trajectories in which the model calls tools that run in megarl's
sandbox, token in, token out.

A trajectory, all of a batch's at once:

    generate (every live trajectory in one engine call)  ->  read the turn's calls (`--tool-parser`)
      -> no call: finished  |  calls: run them (the whole batch's calls together, through the sandbox's workers)
      -> append the output  ->  generate again from prompt + everything so far  ...

- The model's tokens are kept as the engine generated them, with mask 1 and the engine's log-probs; only a tool's
  output is tokenised, with mask 0 and log-prob 0, so the loss never sees it. With a chat template
  (`--tool-response-format chat`) the output is the template's tool turn, rendered for the new messages only,
  and a turn ends at the model's end-of-turn token; otherwise it is the parser's text wrapper (```` ```output ````,
  `<tool_response>`) right after the call, and a turn ends at the call's closing tag (a stop string).
- Limits: `--max-turns` model turns, `--max-tool-calls` calls (a turn that calls beyond them ends the trajectory,
  those calls unrun), `--max-tool-output-tokens` per call (cut, with a marker saying how much), and
  `--max-response-len` for the whole trajectory after the prompt, the model's and the tools' tokens together
  (cut there: truncated).
- A call that cannot be read, names an unknown tool, times out, crashes or floods is an error observation the model
  sees; nothing a call does stops the rollout or loses a trajectory.
- Reward: the row's verifier judges the final turn's text (after the last tool output); `--tool-call-cost` and
  `--tool-format-bonus` shape it, both off by default. With --reward-overlap a trajectory is scored as soon as it
  finishes, while the others take more turns; the function waits for the last scores before it returns.
- Per-sample metadata (reported as `sample_<key>` means): `turns`, `tool_calls`, `tool_used`, `tool_errors`,
  `tool_timeouts`, `tool_tokens`; `step_metrics()` gives the latest call's tool latency p50 / p99.
- OpenEnv (`--openenv pkg.module:Class` in-process, or `--openenv-url` a server): one environment per trajectory,
  reset with the row's label, a step per `--openenv-tool` call (in a turn's order), its observation a tool output
  like any other; an episode the environment ends ends the trajectory. The step rewards' sum is the sample's
  `env_reward` (with `env_steps`, `env_done`), and a row whose verifier is `env_reward` is judged on it (its label
  becomes `{"env_reward", "env_done", "row"}`). `megarl.tool_calls.openenv` says the rest.

A trajectory without a call is exactly what `single_turn` makes of the same completion (besides its metadata).
Peers: verl's tool agent loop, slime's retool example and OpenRLHF's agent API mask tool output the same way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

from megarl.data import PromptRecord
from megarl.reward import RewardFn, Scores, StreamingReward
from megarl.rollout.base import Completion, RolloutEngine, SamplingParams
from megarl.rollout.functions import Rollout, register_rollout
from megarl.reward import compose
from megarl.rollout.slots import ROLLOUTS, ToolUseOptions
from megarl.tool_calls import TOOL_PARSERS, TOOLS, Observation, ParseError, ToolCall, build_tool, tool_settings
from megarl.tool_calls import openenv
from megarl.samples import Sample, SampleStatus
from megarl.verifiers import VerifyResult

if TYPE_CHECKING:  # megarl.config imports this package's slots: the run's sections reach here as arguments
    from megarl.config import SandboxConfig

UNAVAILABLE = "error: the tool is unavailable"  # what --tool-calls-fail answers every call


@dataclass
class _Trajectory:
    group: int
    record: PromptRecord
    budget: int  # response tokens left: policy and tools together
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    version: int = 0
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tool_tokens: int = 0
    final_text: str = ""
    status: SampleStatus | None = None  # set when finished
    slot: int = 0  # its place in the call's trajectories: its environment session's
    env: bool = False  # an OpenEnv environment runs beside it
    env_reward: float = 0.0  # the sum of its environment's step rewards
    env_steps: int = 0
    env_done: bool = False  # its environment ended the episode
    refusal: str = ""  # the first call the tool's sandbox refused or cut off (a hacking signal's evidence)

    def append(self, ids: Sequence[int], logp: Sequence[float] | None) -> None:
        """The policy's tokens (with their log-probs) or, with `logp=None`, anything else (mask 0)."""
        self.ids += ids
        self.mask += [1 if logp is not None else 0] * len(ids)
        self.logp += list(logp) if logp is not None else [0.0] * len(ids)
        self.budget -= len(ids)

    def sample(self) -> Sample:
        return Sample(group=self.group, prompt_index=self.record.index, prompt_ids=list(self.record.prompt_ids),
                      response_ids=self.ids, loss_mask=self.mask, rollout_logprobs=self.logp,
                      weight_version=self.version, status=self.status, response_text=self.final_text,
                      metadata={"turns": float(self.turns), "tool_calls": float(self.calls),
                                "tool_used": float(self.calls > 0), "tool_errors": float(self.errors),
                                "tool_timeouts": float(self.timeouts), "tool_tokens": float(self.tool_tokens),
                                **({"env_reward": self.env_reward, "env_steps": float(self.env_steps),
                                    "env_done": float(self.env_done)} if self.env else {})})

    def scoring_record(self) -> PromptRecord:
        """The row its reward reads: with an environment and the `env_reward` verifier, the label carries the
        environment's reward (`megarl.verifiers.env_reward`)."""
        if not (self.env and any(p.name == "env_reward" for p in compose.parse(self.record.verifier).parts)):
            return self.record
        return replace(self.record, label={"env_reward": self.env_reward, "env_done": self.env_done,
                                           "row": self.record.label})


class ToolUse(Rollout):
    """The `tool_use` rollout function with its options (`megarl.rollout.slots.ToolUseOptions`) and tools; see the
    module docstring."""

    def __init__(self, tc: ToolUseOptions, sb: SandboxConfig | None, tools: dict | None = None,
                 options: dict[str, dict] | None = None):
        """`sb`: the run's `--sandbox*` section (None: the tools' default sandbox); `tools`: name -> tool, instead of
        building the `--tools` (tests pass scripted ones); `options`: name -> the keyword arguments of a tool that
        declares options (`TOOLS.kwargs(cfg)`)."""
        self.tc = tc
        self.parser = TOOL_PARSERS.build(tc.tool_parser)
        names = [t.strip() for t in tc.tools.split(",") if t.strip()]
        settings, options = tool_settings(tc, sb), options or {}
        self.tools = tools if tools is not None else {
            name: build_tool(name, settings, **options.get(name, {})) for name in names}
        self._latencies: list[float] = []
        self.env_cls = openenv.load_environment(tc.openenv) if tc.openenv else None
        if self.env_cls is not None:
            openenv.action_and_observation_types(self.env_cls)  # the annotations are read now, not mid-rollout
        if tc.openenv_url:
            openenv.check_server(tc.openenv_url, tc.openenv_timeout)

    def __call__(self, engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams,
                 reward: RewardFn, tokenizer) -> list[Sample]:
        self._latencies = []
        chat = self._chat(tokenizer)
        turn = replace(params, stop=params.stop + (() if chat else self.parser.stop))
        trajs = [_Trajectory(g, record, params.max_new_tokens) for g, record in enumerate(prompts)
                 for _ in range(params.n)]
        if self.env_cls is None and not self.tc.openenv_url:
            return self._trajectories(engine, prompts, params, reward, tokenizer, trajs, chat, turn, None)
        for i, t in enumerate(trajs):
            t.slot, t.env = i, True
        with openenv.EnvSessions(self.env_cls, self.tc.openenv_url, self.tc.openenv_timeout, len(trajs)) as envs:
            envs.reset([openenv.reset_arguments(t.record) for t in trajs])
            return self._trajectories(engine, prompts, params, reward, tokenizer, trajs, chat, turn, envs)

    def _trajectories(self, engine, prompts, params, reward, tokenizer, trajs, chat, turn,
                      envs: openenv.EnvSessions | None) -> list[Sample]:
        completions = [c for group in engine.generate([p.prompt_ids for p in prompts], turn) for c in group]
        # --reward-overlap: trajectories are scored as they finish, while the others take more turns
        scoring = _Scoring(reward, trajs) if isinstance(reward, StreamingReward) and reward.overlaps(prompts) else None
        live, rounds = trajs, 0
        while live:
            calls = {id(t): self._take_turn(t, c, tokenizer) for t, c in zip(live, completions)}
            observations = self._run([(t, calls[id(t)]) for t in live if calls[id(t)]], envs)
            for t in live:
                if t.status is None:
                    self._append_output(t, observations[id(t)], tokenizer, chat)
                if t.status is None and t.env_done:
                    t.status = SampleStatus.COMPLETED  # the environment ended the episode
            live = [t for t in live if t.status is None]
            if scoring is not None:
                scoring.submit_finished()
            if not live:
                break
            rounds += 1
            more = replace(turn, n=1, max_new_tokens=max(t.budget for t in live),
                           seed=None if params.seed is None else params.seed + 1_000_003 * rounds)
            completions = [g[0] for g in engine.generate([list(t.record.prompt_ids) + t.ids for t in live], more)]
        samples = [t.sample() for t in trajs]
        results = scoring.results() if scoring is not None else reward(samples, [t.scoring_record() for t in trajs])
        return [replace(s, reward=self._shaped(float(r.score), t), outcome=r.outcome, extracted=r.extracted,
                        signals={**r.signals, **({"tool_refusal": t.refusal} if t.refusal else {})})
                for s, t, r in zip(samples, trajs, results)]

    def _chat(self, tokenizer) -> bool:
        mode = self.tc.tool_response_format
        return bool(getattr(tokenizer, "chat_template", None)) if mode == "auto" else mode == "chat"

    def _take_turn(self, t: _Trajectory, c: Completion, tokenizer) -> list[ToolCall | ParseError]:
        """Append the model's turn; the calls to run, or [] with the trajectory finished."""
        ids, logp, reason = c.token_ids[: t.budget], c.logprobs[: t.budget], c.finish_reason
        if len(ids) < len(c.token_ids):
            reason = "length"
        t.append(ids, logp)
        t.version, t.turns = c.weight_version, t.turns + 1
        t.final_text = tokenizer.decode(ids, skip_special_tokens=True)
        if reason == "abort":  # the engine stopped this turn from outside: the trajectory ends unfinished
            t.status = SampleStatus.ABORTED
            return []
        if reason == "length" or t.budget <= 0:
            t.status = SampleStatus.TRUNCATED
            return []
        calls = self.parser.parse(tokenizer.decode(ids, skip_special_tokens=False))
        if not calls or t.turns >= self.tc.max_turns or t.calls + len(calls) > self.tc.max_tool_calls:
            t.status = SampleStatus.COMPLETED  # the model's answer, or a call beyond the limits: left unrun
            return []
        return calls

    def _run(self, pending: list[tuple[_Trajectory, list]],
             envs: openenv.EnvSessions | None = None) -> dict[int, list[Observation]]:
        """Every call of the batch: each tool's calls in one `run_many` (concurrent in the sandbox), the
        environment's through `envs`."""
        out: dict[int, list[Observation | None]] = {id(t): [None] * len(calls) for t, calls in pending}
        by_tool: dict[str, list[tuple[int, int, ToolCall]]] = {}
        env_calls: list[tuple[_Trajectory, int, ToolCall]] = []
        for t, calls in pending:
            for i, call in enumerate(calls):
                if isinstance(call, ParseError):
                    out[id(t)][i] = Observation(f"error: {call.message}", "error")
                elif self.tc.tool_calls_fail:
                    out[id(t)][i] = Observation(UNAVAILABLE, "error")
                elif envs is not None and call.name == self.tc.openenv_tool:
                    env_calls.append((t, i, call))
                elif call.name not in self.tools:
                    out[id(t)][i] = Observation(f"error: no tool named {call.name[:100]!r}; the tools are "
                                                f"{', '.join(sorted(self.tools))}", "error")
                else:
                    by_tool.setdefault(call.name, []).append((id(t), i, call))
        for name, items in by_tool.items():
            results = self.tools[name].run_many([call for _, _, call in items])
            for (key, i, _), obs in zip(items, results):
                out[key][i] = obs
                self._latencies.append(obs.seconds)
        if envs is not None:
            self._step_envs(envs, env_calls, out)
        for t, _ in pending:
            t.calls += len(out[id(t)])
            t.errors += sum(o.status == "error" for o in out[id(t)])
            t.timeouts += sum(o.status == "timeout" for o in out[id(t)])
        return out

    def _step_envs(self, envs: openenv.EnvSessions, env_calls: list[tuple[_Trajectory, int, ToolCall]],
                   out: dict[int, list[Observation | None]]) -> None:
        """The environment calls: every trajectory's k-th call in round k, the trajectories' concurrently, a
        trajectory's in its turn's order; a call after its episode ended is an error observation."""
        rounds: list[list[tuple[_Trajectory, int, ToolCall]]] = []
        seen: dict[int, int] = {}
        for t, i, call in env_calls:
            k = seen[id(t)] = seen.get(id(t), -1) + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((t, i, call))
        for items in rounds:
            live = [(t, i, call) for t, i, call in items if not t.env_done and t.status is None]
            for t, i, _ in items:
                if t.env_done:
                    out[id(t)][i] = Observation("error: the episode is over", "error")
            start = time.perf_counter()
            steps = envs.step([(t.slot, call.arguments) for t, _, call in live]) if live else []
            seconds = time.perf_counter() - start
            for (t, i, _), step in zip(live, steps):
                if isinstance(step, BaseException):  # the session is gone: the trajectory cannot go on
                    t.status = SampleStatus.FAILED
                    out[id(t)][i] = Observation(f"error: the environment was lost ({step})", "timeout")
                    continue
                t.env_steps += 1
                t.env_reward += float(step.reward or 0.0)
                t.env_done = t.env_done or step.done
                out[id(t)][i] = Observation(step.text, "error" if step.error else "ok", seconds)
                self._latencies.append(seconds)
        for t, i, _ in env_calls:  # a failed trajectory's calls after the loss
            if out[id(t)][i] is None:
                out[id(t)][i] = Observation("error: the environment was lost", "timeout")

    def _append_output(self, t: _Trajectory, observations: list[Observation], tokenizer, chat: bool) -> None:
        """The calls' outputs as tokens with mask 0, within the trajectory's budget."""
        texts = [self._cut(o.text, tokenizer) for o in observations]
        if not t.refusal:
            from megarl.verifiers.signals import tool_refusal

            t.refusal = next((r for o in observations if (r := tool_refusal(o.text, o.status, o.refused))), "")
        text = chat_tool_turn(tokenizer, texts) if chat else "".join(self.parser.wrap(x) for x in texts)
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = ids[: t.budget]
        t.append(ids, None)
        t.tool_tokens += len(ids)
        if t.budget <= 0:
            t.status = SampleStatus.TRUNCATED

    def _cut(self, text: str, tokenizer) -> str:
        limit = self.tc.max_tool_output_tokens
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text
        return f"{tokenizer.decode(ids[:limit], skip_special_tokens=True)}\n[{len(ids) - limit} more tokens cut]"

    def _shaped(self, score: float, t: _Trajectory) -> float:
        bonus = self.tc.tool_format_bonus if t.calls and not (t.errors or t.timeouts) else 0.0
        return score - self.tc.tool_call_cost * t.calls + bonus

    def step_metrics(self) -> dict[str, float]:
        """Of the latest call: tool latency p50 / p99 over the calls that ran, in seconds."""
        lat = sorted(self._latencies)
        if not lat:
            return {}
        return {"tool_latency_p50": statistics.median(lat), "tool_latency_p99": lat[min(len(lat) - 1,
                                                                                         int(0.99 * len(lat)))]}

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()


class _Scoring:
    """A batch's trajectories handed to the reward as they finish (`RewardMeter.submit`), and their results."""

    def __init__(self, reward: StreamingReward, trajs: list[_Trajectory]):
        self.reward, self.trajs = reward, trajs
        self.submitted: dict[int, tuple[Scores, int]] = {}  # trajectory -> (its submission, its place in it)

    def submit_finished(self) -> None:
        done = [i for i, t in enumerate(self.trajs) if t.status is not None and i not in self.submitted]
        if done:
            scores = self.reward.submit([self.trajs[i].sample() for i in done],
                                        [self.trajs[i].scoring_record() for i in done])
            self.submitted.update((i, (scores, k)) for k, i in enumerate(done))

    def results(self) -> list[VerifyResult]:
        """Every trajectory's result, in order (waits for those still being scored)."""
        return [scores.result()[k] for scores, k in (self.submitted[i] for i in range(len(self.trajs)))]


def chat_tool_turn(tokenizer, contents: Sequence[str]) -> str:
    """The text the chat template puts after an assistant turn for these tool messages, up to the opened
    assistant turn: the template rendered with and without them (after a stand-in exchange), the difference.
    What the template writes after the assistant's end-of-turn token (Qwen's newline) comes first, since the
    model's own turn ended at that token."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + [{"role": "tool", "content": c} for c in contents], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the tokenizer's chat template changes earlier turns when a tool turn follows: use "
                         "--tool-response-format text")
    eos = tokenizer.eos_token or ""
    tail = before[before.rfind(eos) + len(eos) :] if eos and eos in before else ""
    return tail + after[len(before) :]


@register_rollout("tool_use", configure=lambda cfg: ToolUse(ROLLOUTS.settings(cfg, "tool_use"), cfg.sandbox,
                                                            options=TOOLS.kwargs(cfg)))
def tool_use(engine: RolloutEngine, prompts: Sequence[PromptRecord], params: SamplingParams, reward: RewardFn,
             tokenizer) -> list[Sample]:
    """Multi-turn tool use with the default settings; the trainer builds it from the run's flags (`configure`)."""
    rollout = ToolUse(ToolUseOptions(), None)
    try:
        return rollout(engine, prompts, params, reward, tokenizer)
    finally:
        rollout.close()

