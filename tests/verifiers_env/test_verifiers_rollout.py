"""`--rollout-function verifiers` against verifiers 0.4.0 itself, in the environment `make verifiers-env` builds:
a taskset written here (`megarl_sum_taskset.py`: `a+b=` problems, reward 1.0 for the right first line), the null
agent program in the subprocess runtime, the verifiers training client posting token ids to megarl's token
endpoint over the built-in engine. The samples' tokens and log-probs are held against what the engine generated,
their rewards against the taskset's rule written again here, and the groups against the prompts. Without the
environment the tests skip and say how to build it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import make_tiny_hf_model
from verifiers_recording_plugin import RecordingEngine
from verifiers_testenv import HERE, first_line_reward, with_chat_template

from megarl.data import PromptRecord
from megarl.rollout import SamplingParams
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.slots import VerifiersOptions
from megarl.rollout.verifiers_env import VerifiersRollout
from megarl.samples import SampleStatus
from megarl.tasks.arithmetic import build_tokenizer

pytestmark = [pytest.mark.slow]  # the environment: conftest.py

PROBLEMS = [("12+3=", "15"), ("7-2=", "5"), ("40+2=", "42")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vf")
    tok = build_tokenizer()
    model = make_tiny_hf_model(tmp / "raw", vocab=len(tok), seed=2)
    tok.save_pretrained(str(model))
    model = with_chat_template(model, tmp / "m")
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "answer": a, "verifier": "arithmetic"}) + "\n"
                            for p, a in PROBLEMS))
    prompts = [PromptRecord(i, p, tok.encode(p), a, "arithmetic") for i, (p, a) in enumerate(PROBLEMS)]
    return model, rows, prompts, tok


def rollout(model, **kw) -> VerifiersRollout:
    return VerifiersRollout(VerifiersOptions(verifiers_taskset="megarl_sum_taskset", verifiers_path=str(HERE),
                                             verifiers_timeout=300, **kw), str(model))


def test_episodes_become_samples_with_the_engines_tokens_and_the_traces_rewards(setup, monkeypatch):
    model, rows, prompts, tok = setup
    monkeypatch.setenv("MEGARL_SUM_ROWS", str(rows))
    engine = BuiltinEngine.from_pretrained(str(model))
    engine.weight_version = 5
    log: list[dict] = []
    fn = rollout(model, verifiers_batch_window=0.5)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    samples = fn(RecordingEngine(engine, log), prompts, params, reward=None, tokenizer=tok)

    assert len(samples) == 9 and [s.group for s in samples] == [g for g in range(3) for _ in range(3)]
    assert [s.prompt_index for s in samples] == [g for g in range(3) for _ in range(3)]
    generated = [(r["prompt"], r["tokens"], r["logprobs"]) for r in log]
    assert len(generated) == 9  # one engine completion per episode, none lost, none extra
    for s, (prompt, answer) in zip(samples, [p for p in PROBLEMS for _ in range(3)]):
        assert s.prompt_ids == tok.encode(prompt)  # the chat template renders the task's prompt as megarl does
        assert (s.prompt_ids, s.response_ids, s.rollout_logprobs) in generated
        generated.remove((s.prompt_ids, s.response_ids, s.rollout_logprobs))
        assert s.loss_mask == [1] * len(s.response_ids) and s.weight_version == 5
        assert s.reward == first_line_reward(tok.decode(s.response_ids, skip_special_tokens=True), answer)
        assert s.outcome == ("correct" if s.reward == 1.0 else "incorrect")
        finished = s.response_ids[-1] == tok.eos_token_id
        assert s.status is (SampleStatus.COMPLETED if finished else SampleStatus.TRUNCATED)
    # the 9 episodes' requests met in the engine: fewer calls than requests
    assert fn.step_metrics()["verifiers_engine_calls"] < 9


def test_rewards_come_from_the_trace_for_a_model_that_answers(setup, monkeypatch):
    """An engine that answers right in even-numbered requests and wrong in odd ones: the traces' rewards are
    1.0 and 0.0 accordingly, whatever order the requests met the engine in."""
    model, rows, prompts, tok = setup
    monkeypatch.setenv("MEGARL_SUM_ROWS", str(rows))
    answers = {tuple(tok.encode(p)): a for p, a in PROBLEMS}

    class Oracle:
        weight_version = 1
        calls = 0

        def generate(self, prompts_, params):
            from megarl.rollout import Completion
            out = []
            for p in prompts_:
                text = answers[tuple(p)] if self.calls % 2 == 0 else "0"
                self.calls += 1
                ids = tok.encode(text + "\n") + [tok.eos_token_id]
                out.append([Completion(ids, [-0.1] * len(ids), "stop", 1)] * params.n)
            return out

    samples = rollout(model)(Oracle(), prompts, SamplingParams(n=2, max_new_tokens=6), reward=None, tokenizer=tok)
    for s, (_, answer) in zip(samples, [p for p in PROBLEMS for _ in range(2)]):
        reply = tok.decode(s.response_ids, skip_special_tokens=True).split("\n")[0]
        assert reply in (answer, "0") and s.reward == (1.0 if reply == answer else 0.0)
        assert s.status is SampleStatus.COMPLETED
    assert sorted(s.reward for s in samples) == [0.0] * 3 + [1.0] * 3


def test_a_missing_taskset_fails_the_call_naming_it(setup, monkeypatch):
    model, rows, prompts, tok = setup
    monkeypatch.setenv("MEGARL_SUM_ROWS", str(rows))
    fn = VerifiersRollout(replace(VerifiersOptions(verifiers_taskset="no_such_taskset_here")), str(model))
    with pytest.raises(RuntimeError, match="no_such_taskset_here"):
        fn(BuiltinEngine.from_pretrained(str(model)), prompts[:1], SamplingParams(max_new_tokens=2), None, tok)


def test_a_task_index_past_the_taskset_fails_naming_the_sizes(setup, monkeypatch):
    model, rows, prompts, tok = setup
    monkeypatch.setenv("MEGARL_SUM_ROWS", str(rows))
    far = [replace(prompts[0], index=7)]
    with pytest.raises(RuntimeError, match="has 3 tasks; asked for task 7"):
        rollout(model)(BuiltinEngine.from_pretrained(str(model)), far, SamplingParams(max_new_tokens=2), None, tok)
