"""`--rollout-function tool_use` token by token, with a scripted engine and a scripted tool: every response token,
mask and log-prob against the trajectory written out by hand; a trajectory without a call against `single_turn`;
the limits; and the loss and its gradient against a hand-masked computation, blind to the tool's tokens."""

from __future__ import annotations

import pytest
import torch

from megarl.config import AlgorithmConfig, SandboxConfig, ToolConfig
from megarl.data import PromptRecord
from megarl.reward import InProcessReward
from megarl.rollout import Completion, SamplingParams, ROLLOUTS
from megarl.rollout.tool_use import UNAVAILABLE, ToolUse, chat_tool_turn
from megarl.tasks.arithmetic import TOKENIZER_CHARS, build_tokenizer
from megarl.tool_calls import Observation
from megarl.samples import SampleStatus

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(chars=TOKENIZER_CHARS + "`<>_[]{}\"'")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def logps(start: int, n: int) -> list[float]:
    """The scripted engine's log-prob of the token at response position i: distinct, so misalignment shows."""
    return [-0.001 * (start + i + 1) for i in range(n)]


class ScriptedEngine:
    """Turn k of a trajectory is `script(prompt_text, k, sample)`; k = the outputs it has seen so far (`marker`).
    A turn ending in EOS_MARK ends with the stop token. Honors max_new_tokens; records every call."""

    weight_version = 3

    def __init__(self, tok, script, marker="```output"):
        self.tok, self.script, self.marker, self.calls = tok, script, marker, []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            group = []
            for j in range(params.n):
                text = self.tok.decode(p)
                prompt_text = text.split("=")[0] + "="
                turn = self.script(prompt_text, text.count(self.marker), j)
                ids = enc(self.tok, turn.removesuffix("$")) + ([EOS] if turn.endswith("$") else [])
                done = len(ids) <= params.max_new_tokens
                ids = ids[: params.max_new_tokens]
                start = len(p) - len(self.tok.encode(prompt_text))
                group.append(Completion(ids, logps(start, len(ids)), "stop" if done else "length", self.weight_version))
            out.append(group)
        return out


class EvalTool:
    """A scripted `python` tool: the code is one of the test's own arithmetic expressions."""

    name = "python"

    def __init__(self, text=None):
        self.batches, self.text = [], text

    def run_many(self, calls):
        self.batches.append(list(calls))
        return [Observation(self.text or str(eval(c.arguments["code"], {})), "ok", 0.25 + 0.5 * i)
                for i, c in enumerate(calls)]

    def close(self):
        pass


def _prompts(tok, *texts):
    return [PromptRecord(i + 10, t, enc(tok, t), str(eval(t.rstrip("="))), "arithmetic") for i, t in enumerate(texts)]


def _rollout(tool=None, **flags):
    tc = ToolConfig(**{"tool_parser": "python", **flags})
    return ToolUse(tc, SandboxConfig(), tools={"python": tool or EvalTool()})


def call_then_answer(prompt, k, j):
    return f"```python\n{prompt[:-1]}\n```\n" if k == 0 else f"{eval(prompt[:-1])}$"


def test_tokens_masks_and_logprobs_line_up_with_the_trajectory(tok):
    prompts = _prompts(tok, "12*34=", "7*8=")
    engine, tool = ScriptedEngine(tok, call_then_answer), EvalTool()
    params = SamplingParams(n=2, max_new_tokens=60, stop_token_ids=(EOS,), seed=5)
    samples = _rollout(tool)(engine, prompts, params, InProcessReward(), tok)
    assert [s.group for s in samples] == [0, 0, 1, 1]
    for s in samples:
        expr = prompts[s.group].prompt[:-1]
        a = enc(tok, f"```python\n{expr}\n```\n")  # the model's call
        b = enc(tok, f"```output\n{eval(expr)}\n```\n")  # the tool's output, in the parser's wrapper
        c = enc(tok, str(eval(expr))) + [EOS]  # the model's answer
        assert s.response_ids == a + b + c
        assert s.loss_mask == [1] * len(a) + [0] * len(b) + [1] * len(c)
        assert s.rollout_logprobs == logps(0, len(a)) + [0.0] * len(b) + logps(len(a) + len(b), len(c))
        assert s.prompt_ids == prompts[s.group].prompt_ids and s.weight_version == 3
        assert (s.status, s.response_text, s.outcome, s.reward) == (SampleStatus.COMPLETED, str(eval(expr)),
                                                                    "correct", 1.0)
        assert s.metadata == {"turns": 2.0, "tool_calls": 1.0, "tool_used": 1.0, "tool_errors": 0.0,
                              "tool_timeouts": 0.0, "tool_tokens": float(len(b))}
    (first_prompts, first), (second_prompts, second) = engine.calls
    assert first_prompts == [p.prompt_ids for p in prompts] and first.n == 2 and first.stop == ("```\n",)
    # token in: the second turn starts from prompt + the model's tokens as generated + the tool's tokens
    assert second_prompts == [list(s.prompt_ids) + s.response_ids[: -len(enc(tok, s.response_text)) - 1]
                              for s in samples]
    assert second.n == 1 and second.stop == ("```\n",) and second.seed != first.seed
    a0, b0 = (len(enc(tok, t)) for t in ("```python\n12*34\n```\n", "```output\n408\n```\n"))
    assert second.max_new_tokens == 60 - min(len(s.response_ids) - len(enc(tok, s.response_text)) - 1
                                             for s in samples)
    assert a0 + b0 == len(samples[0].response_ids) - 4
    assert [len(batch) for batch in tool.batches] == [4], "the whole batch's calls go to the tool at once"


def test_a_trajectory_without_a_call_is_the_single_turn_sample(tok):
    prompts = _prompts(tok, "3*4=", "5*6=")
    answer = lambda p, k, j: f"{eval(p[:-1]) + j}$" if j < 2 else "1234567890"
    params = SamplingParams(n=3, max_new_tokens=6, stop_token_ids=(EOS,), seed=1)
    tool = EvalTool()
    ours = _rollout(tool)(ScriptedEngine(tok, answer), prompts, params, InProcessReward(), tok)
    theirs = ROLLOUTS.get("single_turn")(ScriptedEngine(tok, answer), prompts, params, InProcessReward(), tok)
    assert tool.batches == []
    for a, b in zip(ours, theirs, strict=True):
        assert a.metadata["turns"] == 1 and a.metadata["tool_calls"] == 0
        a.metadata = b.metadata = {}
        assert a == b
    assert [s.status for s in ours] == ([SampleStatus.COMPLETED] * 2 + [SampleStatus.TRUNCATED]) * 2


def test_without_a_call_the_builtin_engine_samples_what_single_turn_samples(tok, tmp_path):
    """The real engine, stop strings asked for and never met: the same tokens and log-probs, bitwise."""
    from helpers import make_tiny_hf_model

    from megarl.rollout.builtin import BuiltinEngine

    path = make_tiny_hf_model(tmp_path / "m", vocab=len(tok), max_position_embeddings=128)
    engine = BuiltinEngine.from_pretrained(path, tokenizer=tok)
    prompts = _prompts(tok, "12+7=", "3*3=")
    params = SamplingParams(n=4, max_new_tokens=24, stop_token_ids=(EOS,), seed=9)
    ours = _rollout()(engine, prompts, params, InProcessReward(), tok)
    theirs = ROLLOUTS.get("single_turn")(engine, prompts, params, InProcessReward(), tok)
    assert all(s.metadata["tool_calls"] == 0 for s in ours)
    assert [(s.response_ids, s.rollout_logprobs, s.status) for s in ours] == \
        [(s.response_ids, s.rollout_logprobs, s.status) for s in theirs]


def test_turn_and_call_limits(tok):
    prompts = _prompts(tok, "2*3=")
    always = lambda p, k, j: "```python\n2*3\n```\n"
    params = SamplingParams(n=1, max_new_tokens=200, stop_token_ids=(EOS,))
    (s,) = _rollout(max_turns=3)(ScriptedEngine(tok, always), prompts, params, InProcessReward(), tok)
    assert (s.metadata["turns"], s.metadata["tool_calls"], s.status) == (3, 2, SampleStatus.COMPLETED)
    assert s.loss_mask[-len(enc(tok, always("", 0, 0))):] == [1] * len(enc(tok, always("", 0, 0))), "last call unrun"
    assert s.response_text == always("", 0, 0) and s.outcome == "no_answer"
    two = lambda p, k, j: "```python\n1\n```\n```python\n2\n```\n"
    (s,) = _rollout(max_tool_calls=1)(ScriptedEngine(tok, two), prompts, params, InProcessReward(), tok)
    assert (s.metadata["turns"], s.metadata["tool_calls"], s.loss_mask) == (1, 0, [1] * len(s.response_ids))


def test_tool_output_is_cut_with_a_marker_and_the_budget_holds(tok):
    prompts = _prompts(tok, "2*3=")
    params = SamplingParams(n=1, max_new_tokens=200, stop_token_ids=(EOS,))
    (s,) = _rollout(EvalTool("1234567890"), max_tool_output_tokens=4)(
        ScriptedEngine(tok, call_then_answer), prompts, params, InProcessReward(), tok)
    a = enc(tok, "```python\n2*3\n```\n")
    b = enc(tok, "```output\n1234\n[6 more tokens cut]\n```\n")
    assert s.response_ids[: len(a) + len(b)] == a + b and s.loss_mask[len(a) : len(a) + len(b)] == [0] * len(b)
    budget = len(a) + 5  # room for five of the output's tokens, none for another turn
    (s,) = _rollout()(ScriptedEngine(tok, call_then_answer), prompts, SamplingParams(max_new_tokens=budget),
                      InProcessReward(), tok)
    assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == budget
    assert s.response_ids == a + enc(tok, "```output\n6\n```\n")[:5] and s.metadata["tool_tokens"] == 5


def test_malformed_and_unknown_calls_and_the_control_become_error_observations(tok):
    prompts = _prompts(tok, "2*3=")
    script = lambda p, k, j: ('<tool_call>{"name": "python", "arguments": {"code": "2*3"}}</tool_call>'
                              '<tool_call>{bad</tool_call><tool_call>{"name": "search"}</tool_call>'
                              if k == 0 else "6$")
    params = SamplingParams(n=1, max_new_tokens=1000, stop_token_ids=(EOS,))
    tool = EvalTool()
    rollout = ToolUse(ToolConfig(tool_parser="hermes"), SandboxConfig(), tools={"python": tool})
    (s,) = rollout(ScriptedEngine(tok, script, marker="<tool_response>"), prompts, params, InProcessReward(), tok)
    outputs = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
    want = ("\n<tool_response>\n6\n</tool_response>\n"
            "\n<tool_response>\nerror: tool call is not valid JSON (JSONDecodeError: Expecting property name "
            "enclosed in double quotes: line 1 column 2 (char 1))\n</tool_response>\n"
            "\n<tool_response>\nerror: no tool named 'search'; the tools are python\n</tool_response>\n")
    assert outputs == "".join(ch for ch in want if ch in tok.get_vocab() or ch in "\n ")  # the tokenizer's chars
    assert s.metadata == {"turns": 2.0, "tool_calls": 3.0, "tool_used": 1.0, "tool_errors": 2.0,
                          "tool_timeouts": 0.0, "tool_tokens": float(s.loss_mask.count(0))}
    assert [len(b) for b in tool.batches] == [1] and s.outcome == "correct"
    control = _rollout(tool_calls_fail=True)
    tool = control.tools["python"]
    (s,) = control(ScriptedEngine(tok, call_then_answer), prompts, params, InProcessReward(), tok)
    assert tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0]) == \
        f"```output\n{UNAVAILABLE}\n```\n" and tool.batches == [] and s.metadata["tool_errors"] == 1


def test_call_cost_and_format_bonus_shape_the_reward(tok):
    prompts = _prompts(tok, "2*3=")
    params = SamplingParams(n=1, max_new_tokens=200, stop_token_ids=(EOS,))
    (s,) = _rollout(tool_call_cost=0.1, tool_format_bonus=0.25)(ScriptedEngine(tok, call_then_answer), prompts, params,
                                                                 InProcessReward(), tok)
    assert s.reward == pytest.approx(1.0 - 0.1 * 1 + 0.25) and s.outcome == "correct"
    (s,) = _rollout()(ScriptedEngine(tok, call_then_answer), prompts, params, InProcessReward(), tok)
    assert s.reward == 1.0  # both off by default


def test_latency_percentiles_of_the_latest_call(tok):
    rollout = _rollout()
    prompts = _prompts(tok, "2*3=", "4*5=")
    rollout(ScriptedEngine(tok, call_then_answer), prompts, SamplingParams(n=2, max_new_tokens=80), InProcessReward(),
            tok)
    # EvalTool: the i-th call of a batch took 0.25 + 0.5 i s -> 0.25, 0.75, 1.25, 1.75
    assert rollout.step_metrics() == {"tool_latency_p50": 1.0, "tool_latency_p99": 1.75}


def test_a_turn_the_engine_aborts_ends_the_trajectory_as_aborted(tok):
    """An engine that stops a turn from outside (SGLang's abort) ends the trajectory there as ABORTED: no tool is
    run for a call the policy may not have finished, and the sample is neither finished nor length-truncated."""

    class AbortingSecondTurn(ScriptedEngine):
        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            if len(self.calls) == 2:
                out = [[Completion(c.token_ids[:3], c.logprobs[:3], "abort", c.weight_version) for c in g] for g in out]
            return out

    tool = EvalTool()
    script = lambda p, k, j: f"```python\n{p[:-1]}\n```\n"  # the model calls the tool every turn
    (s,) = _rollout(tool)(AbortingSecondTurn(tok, script), _prompts(tok, "12*34="),
                          SamplingParams(max_new_tokens=80), InProcessReward(), tok)
    assert s.status is SampleStatus.ABORTED and s.metadata["turns"] == 2 and len(tool.batches) == 1


def test_chat_models_get_the_templates_tool_turn(tok):
    """With a chat template the output is the template's tool turn (after what it writes past the assistant's
    end-of-turn token) and turns end at that token: no stop strings."""
    chat = build_tokenizer(chars=TOKENIZER_CHARS + "`<>_[]{}\"'")
    chat.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}<|endoftext|>\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    assert chat_tool_turn(chat, ["408", "7"]) == "\ntool: 408<|endoftext|>\ntool: 7<|endoftext|>\nassistant: "
    script = lambda p, k, j: "```python\n12*34\n```$" if k == 0 else "408$"
    engine = ScriptedEngine(chat, script, marker="tool: ")
    (s,) = _rollout()(engine, _prompts(chat, "12*34="), SamplingParams(max_new_tokens=80, stop_token_ids=(EOS,)),
                      InProcessReward(), chat)
    a, b = enc(chat, "```python\n12*34\n```") + [EOS], enc(chat, "\ntool: 408<|endoftext|>\nassistant: ")
    assert s.response_ids == a + b + enc(chat, "408") + [EOS] and EOS in b
    assert s.loss_mask == [1] * len(a) + [0] * len(b) + [1] * 4
    assert [p.stop for _, p in engine.calls] == [(), ()]


def test_the_python_tool_in_the_sandbox(tok):
    """The real `python` tool: the scripted model's code runs in the local sandbox."""
    rollout = ToolUse(ToolConfig(tool_parser="python", tool_timeout=5), SandboxConfig())
    try:
        (s,) = rollout(ScriptedEngine(tok, call_then_answer), _prompts(tok, "123*456="),
                       SamplingParams(max_new_tokens=80, stop_token_ids=(EOS,)), InProcessReward(), tok)
    finally:
        rollout.close()
    assert tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0]) == "```output\n56088\n```\n"
    assert s.outcome == "correct" and rollout.step_metrics()["tool_latency_p50"] > 0


class RefusedTool(EvalTool):
    """A call whose program caught its sandbox's refusal and printed the right answer anyway."""

    def run_many(self, calls):
        return [Observation(o.text, o.status, o.seconds, "seccomp denied: socket(AF_INET) x1")
                for o in super().run_many(calls)]


def test_a_refusal_the_call_survived_is_a_signal_the_model_never_sees(tok):
    (s,) = _rollout(RefusedTool())(ScriptedEngine(tok, call_then_answer), _prompts(tok, "12*34="),
                                   SamplingParams(max_new_tokens=60, stop_token_ids=(EOS,)), InProcessReward(), tok)
    assert s.signals == {"tool_refusal": "tool: seccomp denied: socket(AF_INET) x1"}
    assert tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0]) == "```output\n408\n```\n"
    assert (s.outcome, s.reward) == ("correct", 1.0)  # a signal, not a verdict
    (plain,) = _rollout()(ScriptedEngine(tok, call_then_answer), _prompts(tok, "12*34="),
                          SamplingParams(max_new_tokens=60, stop_token_ids=(EOS,)), InProcessReward(), tok)
    assert plain.signals == {}


def test_samples_rows_mark_the_masked_spans(tok):
    from megarl.metrics import rollout_sample_rows

    prompts = _prompts(tok, "12*34=")
    samples = _rollout()(ScriptedEngine(tok, call_then_answer), prompts, SamplingParams(max_new_tokens=80),
                         InProcessReward(), tok)
    (row,) = rollout_sample_rows(1, samples, {10: prompts[0]}, 4, tokenizer=tok)
    assert row["trajectory"] == [{"mask": 1, "text": "```python\n12*34\n```\n"},
                                 {"mask": 0, "text": "```output\n408\n```\n"},
                                 {"mask": 1, "text": "408<|endoftext|>"}]
    assert row["response"] == "408" and row["tool_calls"] == 1


def test_loss_and_gradient_ignore_the_tool_tokens(tok):
    """The actor's loss over packed tool_use samples equals a hand-masked computation over exactly the policy's
    tokens, and neither it nor its gradient moves when the model's probabilities of tool-output tokens change."""
    from megarl.stages.algorithm import pack
    from megarl.stages.update import make_loss_fn

    prompts = _prompts(tok, "12*34=", "7*8=")
    samples = _rollout()(ScriptedEngine(tok, call_then_answer), prompts, SamplingParams(n=2, max_new_tokens=60),
                         InProcessReward(), tok)
    packed = pack(samples, pad_id=1)
    B, S = packed.tokens.shape
    adv = torch.tensor([0.5, -1.0, 1.5, -0.25])
    a = AlgorithmConfig(entropy_coef=0.01)
    loss_fn = make_loss_fn(a, 60)

    def loss_and_grad(logits):
        logits = logits.clone().requires_grad_(True)
        logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
        logp = logp_all.gather(2, packed.tokens[:, 1:, None]).squeeze(2)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        mb = {"_real_rows": B, "loss_mask": packed.loss_mask, "rollout_logp": packed.rollout_logp,
              "advantages": adv, "old_logp": logp.detach(), "entropy": entropy}
        num, den, _ = loss_fn(logp, mb)
        loss = num / den
        loss.backward()
        return loss.detach(), logits.grad, logp_all, entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, len(tok), generator=g)
    loss, grad, logp_all, entropy = loss_and_grad(logits)

    # by hand: token mean over the policy's tokens only, from each sample's own mask (not the packed one)
    terms = []
    for b, s in enumerate(samples):
        for j, m in enumerate(s.loss_mask):
            if m:
                col = len(s.prompt_ids) + j - 1  # the column that predicts response token j
                lp = logp_all[b, col, s.response_ids[j]]
                terms.append(-adv[b] * torch.exp(lp - lp.detach()) - 0.01 * entropy[b, col])
    torch.testing.assert_close(loss, torch.stack(terms).mean().detach(), rtol=0, atol=1e-6)

    tool_cols = torch.zeros(B, S, dtype=torch.bool)
    for b, s in enumerate(samples):
        for j, m in enumerate(s.loss_mask):
            if not m:
                tool_cols[b, len(s.prompt_ids) + j - 1] = True
    assert int(tool_cols.sum()) == sum(s.loss_mask.count(0) for s in samples) > 0
    moved = torch.where(tool_cols[..., None], torch.randn(B, S, len(tok), generator=g) * 5, logits)
    loss2, grad2, _, _ = loss_and_grad(moved)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert grad[tool_cols].abs().max() == 0 and grad[~tool_cols].abs().max() > 0


def test_the_rollout_stage_reports_the_tool_metrics(tok):
    """Through the Collector (the latencies of the call join the step's metrics) and the step's reduction."""
    from megarl.config import RolloutConfig
    from megarl.data import PromptSampler
    from megarl.mcore.parallel import ParallelInfo
    from megarl.stages.collect import Collector
    from megarl.stages.report import _tool_metrics

    info = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    prompts = _prompts(tok, "2*3=", "4*5=")
    collector = Collector(ScriptedEngine(tok, call_then_answer), _rollout(), InProcessReward(), tok, prompts,
                          PromptSampler(2, seed=0), RolloutConfig(n_samples_per_prompt=2, max_response_len=80),
                          global_batch=2, seed=0, info=info)
    rollout = collector(step=0)
    assert (rollout.metrics["tool_latency_p50"], rollout.metrics["tool_latency_p99"]) == (1.0, 1.75)
    # sums over ranks of the per-sample numbers: 10 trajectories, 6 called (8 calls, 2 errors, 1 timeout)
    g = {"n_samples": 10, "response_tokens": 400, "sample_tool_used": 6, "sample_tool_calls": 8,
         "sample_tool_errors": 2, "sample_tool_timeouts": 1, "sample_tool_tokens": 100,
         "tool_latency_p50_max": 0.5, "tool_latency_p99_max": 2.0}
    assert _tool_metrics(g) == {"tool_call_rate": 0.6, "tool_error_rate": 0.25, "tool_timeout_rate": 0.125,
                                "tool_output_frac": 0.25, "tool_latency_p50": 0.5, "tool_latency_p99": 2.0}


def test_with_reward_overlap_trajectories_are_scored_as_they_finish_into_the_same_samples(tok):
    from megarl.reward import RewardMeter

    def mixed(prompt, k, j):  # the first sample answers at once; the second calls the tool first
        return f"{eval(prompt[:-1])}$" if j == 0 else call_then_answer(prompt, k, j)

    prompts = _prompts(tok, "12*34=", "7*8=")
    params = SamplingParams(n=2, max_new_tokens=60, stop_token_ids=(EOS,), seed=5)
    serial = _rollout()(ScriptedEngine(tok, mixed), prompts, params, InProcessReward(), tok)
    scored_turns = []

    class Spy(InProcessReward):
        def __call__(self, samples, records):
            scored_turns.extend(s.metadata["turns"] for s in samples)
            return super().__call__(samples, records)

    meter = RewardMeter(Spy(), overlap=True)
    assert _rollout()(ScriptedEngine(tok, mixed), prompts, params, meter, tok) == serial
    assert [s.reward for s in serial] == [1.0] * 4
    assert scored_turns == [1.0, 1.0, 2.0, 2.0], "the direct answers go to the reward before the second turn"
