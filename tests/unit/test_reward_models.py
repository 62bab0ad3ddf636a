"""Reward models beside the rule verifiers: `hf_rm` against transformers' own forward, its resident server,
`remote_rm` against a local server that fails, hangs and answers garbage, reward specs (weighted sums, a rule
gating a model), a mixed batch through the router, and the health metrics by hand."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import make_tiny_reward_model

from megarl.verifiers.base import VerifyResult

TEXTS = [("12+7=", "19"), ("3*4=", "12<|endoftext|>"), ("100-1=", "99 and more words here"), ("1+1=", ""),
         ("a much longer prompt, 5+5=", "10"), ("9/3=", "3")]


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    """A random 2-layer Qwen2ForSequenceClassification (1 label) with the arithmetic task's tokenizer."""
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm"), seed=3)


def _reference(path, texts) -> list[float]:
    """transformers' own forward, one unpadded text at a time: logits[0, 0] of the sequence classifier."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            assert 1 not in ids[0].tolist(), "no pad id in the text: the reference needs no padding logic"
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_hf_rm_equals_transformers_forward_for_any_batch_size_and_padding(tiny_rm):
    from megarl.reward.hf_scorer import HFRewardModel

    want = _reference(tiny_rm, [p + r for p, r in TEXTS])
    rows = [(p, r, None) for p, r in TEXTS]
    for batch_size in (1, 4, 16):
        for side in ("right", "left"):
            got = HFRewardModel(tiny_rm, batch_size=batch_size, padding_side=side).score(rows)
            assert got == pytest.approx(want, abs=1e-5), (batch_size, side)
    assert max(want) - min(want) > 1e-3, "distinct texts get distinct scores (the test can fail)"


def test_hf_rm_uses_its_tokenizers_chat_template_and_normalises(tiny_rm, tmp_path):
    import shutil

    from megarl.reward.hf_scorer import HFRewardModel

    chat = tmp_path / "chat"
    shutil.copytree(tiny_rm, chat)
    template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    cfg = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    config = json.loads((chat / "config.json").read_text())
    (chat / "config.json").write_text(json.dumps({**config, "reward_mean": 0.25, "reward_std": 2.0}))
    rm = HFRewardModel(chat, normalize=True)
    assert rm.text("2+2=", "4") == "u:2+2=;a:4;"  # the template, by hand
    assert rm.text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}], "4") == \
        "s:be brief;u:2+2=;a:4;"
    want = _reference(tiny_rm, ["u:2+2=;a:4;"])[0]
    assert rm.score([("2+2=", "4", None)])[0] == pytest.approx((want - 0.25) / 2.0, abs=1e-5)
    with pytest.raises(ValueError, match="reward_mean"):
        HFRewardModel(tiny_rm, normalize=True)


def test_hf_rm_refuses_a_causal_lm(tiny_qwen2):
    from megarl.reward.hf_scorer import HFRewardModel

    with pytest.raises(ValueError, match="ForSequenceClassification"):
        HFRewardModel(tiny_qwen2)


@pytest.mark.slow
def test_served_hf_rm_stays_resident_and_comes_back_after_dying(tiny_rm):
    from megarl.reward.hf_scorer import HFRewardModel
    from megarl.reward.models import REWARD_MODELS

    rows = [(p, r, None) for p, r in TEXTS]
    want = HFRewardModel(tiny_rm).score(rows)
    rm = REWARD_MODELS.build("hf_rm", model=str(tiny_rm), batch_size=4, timeout_s=60)
    try:
        first = rm.score(rows)
        pid = rm._proc.pid
        second = rm.score(rows[::-1])
        assert rm._proc.pid == pid and rm.restarts == 0, "one server, loaded once, for every batch"
        assert [r.model_score for r in first] == [None] * len(rows)
        assert [r.score for r in first] == pytest.approx(want, abs=1e-6)
        assert [r.score for r in second] == pytest.approx(want[::-1], abs=1e-6)
        assert [r.outcome for r in first] == ["correct" if s > 0 else "incorrect" for s in want]
        rm._proc.kill()
        rm._proc.wait(timeout=10)
        assert [r.score for r in rm.score(rows[:2])] == pytest.approx(want[:2], abs=1e-6)
        assert rm.restarts == 1
    finally:
        rm.close()
    assert rm._proc is None


# -- a local server that misbehaves on request --------------------------------------------------------------------


class FlakyRM:
    """The response text says how to answer: `ok:<x>` scores x; `500` always fails; `flaky:<x>` fails twice, then
    scores x; `hang` never answers in time; `badjson` sends broken JSON; `nonumber` a reply without a number."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.stop = threading.Event()
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kind, _, value = body["response"].partition(":")
                with lock:
                    outer.calls[body["response"]] = n = outer.calls.get(body["response"], 0) + 1
                if kind == "hang":
                    outer.stop.wait(30)
                    return
                if kind == "500" or (kind == "flaky" and n <= 2):
                    self._send(500, b"oops")
                elif kind == "badjson":
                    self._send(200, b"{not json")
                elif kind == "nonumber":
                    self._send(200, b'{"score": "high"}')
                else:
                    self._send(200, json.dumps({"score": float(value) + len(body["prompt"])}).encode())

            def _send(self, code, data):
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def flaky_rm():
    server = FlakyRM()
    yield server
    server.close()


@pytest.mark.slow
def test_remote_rm_retries_then_maps_failures_to_outcomes_in_order(flaky_rm):
    from megarl.reward.models import REWARD_MODELS

    responses = ["ok:1.5", "500", "flaky:2", "hang", "badjson", "ok:-3", "nonumber", "flaky:0.25"]
    rows = [("pq", r, None) for r in responses]
    rm = REWARD_MODELS.build("remote_rm", url=flaky_rm.url, timeout_s=1.0, retries=2, backoff_s=0.01, concurrency=4)
    start = time.perf_counter()
    try:
        results = rm.score(rows)
    finally:
        rm.close()
    elapsed = time.perf_counter() - start
    got = [(r.outcome, r.score) for r in results]
    assert got == [("correct", 3.5), ("parse_error", 0.0), ("correct", 4.0), ("timeout", 0.0),
                   ("parse_error", 0.0), ("incorrect", -1.0), ("parse_error", 0.0), ("correct", 2.25)]
    assert "HTTP 500" in results[1].normalized and "3 attempts" in results[1].normalized
    assert "not JSON" in results[4].normalized and "no number" in results[6].normalized
    assert flaky_rm.calls["500"] == 3 and flaky_rm.calls["hang"] == 3 and flaky_rm.calls["flaky:2"] == 3
    assert flaky_rm.calls["ok:1.5"] == 1, "a good answer is asked once"
    assert 3 * 1.0 <= results[3].seconds < 3 * 1.0 + 5, "a hanging server: three attempts of 1 s"
    assert elapsed < 20


def test_remote_rm_refuses_a_missing_or_bad_url():
    from megarl.reward.models import REWARD_MODELS

    with pytest.raises(ValueError, match="--remote-rm-url is not set"):
        REWARD_MODELS.build("remote_rm")
    with pytest.raises(ValueError, match="http:// or https://"):
        REWARD_MODELS.build("remote_rm", url="localhost:8000")


# -- reward specs -------------------------------------------------------------------------------------------------


def test_reward_spec_syntax_and_errors():
    from megarl.reward.compose import Part, parse, spec_error

    assert parse("math").kind == "one" and parse("hf_rm").parts == (Part("hf_rm", 1.0),)
    assert parse("0.7*math + 0.3*hf_rm").parts == (Part("math", 0.7), Part("hf_rm", 0.3))
    assert parse("hf_rm + 0*arithmetic").kind == "sum"
    assert parse("math > hf_rm").parts == (Part("math", 1.0), Part("hf_rm", 0.5))
    assert parse("math > 0.1*hf_rm").parts[1] == Part("hf_rm", 0.1)
    assert spec_error("math > 0.1*hf_rm") is None
    assert "unknown verifier 'chess'" in spec_error("math + chess")
    for bad in ("math >", "2*math > hf_rm", "a > b > c", "math + ", "0.5 math"):
        assert "reward spec" in spec_error(bad), bad


def test_combining_parts_by_hand():
    from megarl.reward.compose import combine, parse

    models = {"hf_rm"}
    right, wrong = VerifyResult(1.0, "correct", extracted="4"), VerifyResult(0.0, "incorrect", extracted="5")
    rm_hi, rm_lo = VerifyResult(2.0, "correct"), VerifyResult(-1.0, "incorrect")
    r = combine(parse("0.7*math + 0.3*hf_rm"), [right, rm_lo], models)
    assert (r.score, r.outcome, r.extracted, r.model_score, r.agrees) == \
        (pytest.approx(0.7 - 0.3), "correct", "4", -1.0, False)
    r = combine(parse("math > hf_rm"), [wrong, rm_hi], models)
    assert r.score == pytest.approx(0.5 / (1 + math.exp(-2.0))) and r.outcome == "incorrect" and r.agrees is False
    r = combine(parse("math > hf_rm"), [right, rm_lo], models)
    assert r.score == pytest.approx(1 + 0.5 / (1 + math.exp(1.0))), "a right answer outranks any wrong one"
    r = combine(parse("hf_rm + 0*math"), [rm_hi, right], models)
    assert (r.score, r.outcome, r.agrees) == (2.0, "correct", True)
    r = combine(parse("math > hf_rm"), [right, VerifyResult(0.0, "timeout", normalized="slow")], models)
    assert (r.score, r.outcome, r.normalized) == (0.0, "timeout", "hf_rm: slow")


def test_rm_health_by_hand():
    from megarl.stages.report import _rm_metrics
    from megarl.reward.pool import batch_health

    results = [VerifyResult(1.0, "correct", model_score=2.0, agrees=True),
               VerifyResult(0.0, "incorrect", model_score=-1.0, agrees=True),
               VerifyResult(0.0, "incorrect", model_score=0.5, agrees=False),
               VerifyResult(1.0, "correct")]
    h = batch_health(results, group_size=2)
    assert (h["rm_n"], h["rm_agree_n"], h["rm_agree_sum"]) == (3, 3, 2)
    m = _rm_metrics({**{k: h[k] for k in ("rm_n", "rm_score_sum", "rm_score_sqsum", "rm_agree_n", "rm_agree_sum")},
                     "rm_seconds_max": 0.1})
    scores = [2.0, -1.0, 0.5]
    mean = sum(scores) / 3
    assert m["rm_score_mean"] == pytest.approx(mean)
    assert m["rm_score_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in scores) / 3))
    assert m["rm_agreement"] == pytest.approx(2 / 3)
    assert "rm_n" not in batch_health([VerifyResult(1.0, "correct")]), "rule-only batches report what they did"


# -- the router: a mixed batch ------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_a_mixed_batch_keeps_its_order(tiny_rm, flaky_rm):
    """math + code + arithmetic rows in reward workers, hf_rm and remote_rm rows in their servers, composed rows
    across both: every row's result is the one its source gives it alone, in place."""
    from megarl.data import PromptRecord
    from megarl.reward import PoolReward, RoutedReward, RewardMeter
    from megarl.reward.hf_scorer import HFRewardModel
    from megarl.samples import Sample, SampleStatus
    from megarl.verifiers import VERIFIERS
    from megarl.reward.pool import RewardPool

    code_truth = {"test": "assert f() == 3", "entry_point": "f"}
    rows = [("arithmetic", "1+1=", "2", "2"), ("hf_rm", "2+2=", "4", None), ("remote_rm", "pq", "ok:0.5", None),
            ("math", "half?", "$\\boxed{0.5}$", "1/2"), ("code", "f", "```python\ndef f():\n    return 3\n```",
                                                         code_truth),
            ("remote_rm", "pq", "hang", None), ("arithmetic > hf_rm", "3+4=", "7", "7"),
            ("hf_rm + 0*arithmetic", "3+4=", "8", "7"), ("remote_rm", "x", "badjson", None),
            ("arithmetic", "1+2=", "4", "3"), ("code", "f", "def f():\n    return 4\n", code_truth)]
    samples = [Sample(group=i, prompt_index=i, prompt_ids=[1], response_ids=[7], loss_mask=[1], rollout_logprobs=[0.0],
                      weight_version=0, status=SampleStatus.COMPLETED, response_text=resp)
               for i, (_, _, resp, _) in enumerate(rows)]
    records = [PromptRecord(i, "rendered " + p, [1], label, name, raw_prompt=p)
               for i, (name, p, _, label) in enumerate(rows)]
    options = {"hf_rm": {"model": str(tiny_rm), "timeout_s": 60},
               "remote_rm": {"url": flaky_rm.url, "timeout_s": 2.0, "retries": 1, "backoff_s": 0.01}}
    with RewardPool(workers=2, timeout_s=30) as pool:
        reward = RoutedReward(PoolReward(pool), options)
        try:
            meter = RewardMeter(reward)
            results = meter(samples, records)
        finally:
            reward.close()
    rm = HFRewardModel(tiny_rm)
    s_rm = rm.score([("2+2=", "4", None), ("3+4=", "7", None), ("3+4=", "8", None)])
    rule = {"code": VERIFIERS.build("code")}
    code = [rule["code"].verify(rows[i][2], code_truth) for i in (4, 10)]
    assert [c.outcome for c in code] == ["correct", "incorrect"]
    want = [(1.0, "correct"), (s_rm[0], "correct" if s_rm[0] > 0 else "incorrect"), (0.5 + len("pq"), "correct"),
            (1.0, "correct"), (1.0, "correct"), (0.0, "timeout"), (1.0 + 0.5 / (1 + math.exp(-s_rm[1])), "correct"),
            (s_rm[2], "incorrect"), (0.0, "parse_error"), (0.0, "incorrect"), (0.0, "incorrect")]
    assert [r.outcome for r in results] == [o for _, o in want]
    assert [r.score for r in results] == pytest.approx([s for s, _ in want], abs=1e-5)
    health = meter.health(group_size=1)
    assert health["rm_n"] == 4, "hf_rm once, remote_rm once with a score, two composed rows"
    assert health["rm_agree_n"] == 2 and health["rm_seconds"] > 0
    assert health["reward_n_timeout"] == 1 and health["reward_n_parse_error"] == 1


# -- megarl-verify with a reward model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_megarl_verify_scores_rows_and_pairs_with_a_reward_model(tiny_rm, tmp_path, capsys):
    from megarl.cli.verify import main
    from megarl.reward.hf_scorer import HFRewardModel

    singles = [{"prompt": p, "response": r, "correct": i % 2 == 0} for i, (p, r) in enumerate(TEXTS)]
    pairs = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}, {"prompt": "9-3=", "chosen": "6", "rejected": ""},
             {"prompt": "1+0=", "chosen": "1", "rejected": "10"}]
    data, out = tmp_path / "rows.jsonl", tmp_path / "scored.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in singles + pairs))
    code = main([str(data), "--verifier", "hf_rm", "--reward-model", str(tiny_rm), "--prompt-key", "prompt",
                 "--output", str(out), "--workers", "0", "--no-progress"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    rm = HFRewardModel(tiny_rm)
    want = rm.score([(r["prompt"], r["response"], None) for r in singles])
    chosen = rm.score([(r["prompt"], r["chosen"], None) for r in pairs])
    rejected = rm.score([(r["prompt"], r["rejected"], None) for r in pairs])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in rows[: len(singles)]] == pytest.approx(want, abs=1e-6)
    assert [r["score_chosen"] for r in rows[len(singles) :]] == pytest.approx(chosen, abs=1e-6)
    assert [r["prefers_chosen"] for r in rows[len(singles) :]] == [c > j for c, j in zip(chosen, rejected)]
    wins = sum(c > j for c, j in zip(chosen, rejected))
    assert f"pairwise accuracy {100 * wins / 3:.1f}% on 3 chosen/rejected pairs" in stdout
    right = sum((s > 0) == r["correct"] for s, r in zip(want, singles))
    assert f"accuracy {100 * right / len(singles):5.1f}% on {len(singles)} labelled rows" in stdout
    assert f"reward model: {len(singles) + 6} scores" in stdout


def test_megarl_verify_names_a_missing_reward_model_flag_or_prompt(tmp_path, capsys):
    from megarl.cli.verify import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n" + json.dumps({"response": "2"}) + "\n")
    code = main([str(data), "--verifier", "hf_rm", "--workers", "0", "--no-progress"])
    _, err = capsys.readouterr()
    assert code == 2 and "--reward-model is not set" in err
    code = main([str(data), "--verifier", "hf_rm", "--workers", "0", "--no-progress", "--strict"])
    _, err = capsys.readouterr()
    assert code == 2 and ":2: missing key 'prompt'" in err and "--prompt-key" in err
    code = main([str(data), "--verifier", "math > hf_rm >", "--no-progress"])
    _, err = capsys.readouterr()
    assert code == 2 and "--verifier: reward spec" in err


# -- llm_judge ------------------------------------------------------------------------------------------------------


class FakeOpenAI:
    """An OpenAI-compatible chat-completions endpoint whose answer is chosen by the graded response (the text after
    'Response: ' in the judge's prompt): `grade:<text>` answers <text>, `badjson` broken JSON, `nochoices` a
    reply without choices. Every prompt it got is kept."""

    def __init__(self):
        self.prompts: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/v1/chat/completions" and body["temperature"] == 0.0
                prompt = body["messages"][0]["content"]
                outer.prompts.append(prompt)
                response = prompt.split("Response: ", 1)[1].split("\n", 1)[0]
                if response == "badjson":
                    data = b"{"
                elif response == "nochoices":
                    data = b'{"choices": []}'
                else:
                    answer = response.removeprefix("grade:")
                    data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_llm_judge_grades_and_calls_malformed_answers_parse_errors():
    from megarl.reward.models import REWARD_MODELS

    server = FakeOpenAI()
    judge = REWARD_MODELS.build("llm_judge", url=server.url, model="judge", retries=1, backoff_s=0.01, timeout_s=5)
    try:
        responses = ["grade:Score: 7", "grade:score=10, well done", "grade:I like it", "badjson", "nochoices",
                     "grade:Score: 2.5"]
        results = judge.score([("What is 2+2?", r, "4") for r in responses])
    finally:
        judge.close()
        server.close()
    assert [(r.outcome, r.score) for r in results] == [
        ("correct", 0.7), ("correct", 1.0), ("parse_error", 0.0), ("parse_error", 0.0), ("parse_error", 0.0),
        ("incorrect", 0.25)], "above the threshold (0.5 unless set) is correct"
    assert "no grade in the judge's answer 'I like it'" in results[2].normalized
    assert "not JSON" in results[3].normalized and "not a chat completion" in results[4].normalized
    assert any("Question: What is 2+2?\nReference answer: 4\nResponse: grade:Score: 7\n" in p for p in server.prompts)


def test_llm_judge_refuses_bad_settings():
    from megarl.reward.models import REWARD_MODELS

    with pytest.raises(ValueError, match="exactly one of --judge-url"):
        REWARD_MODELS.build("llm_judge")
    with pytest.raises(ValueError, match="--judge-template"):
        REWARD_MODELS.build("llm_judge", url="http://x/v1", template="{question}")
    with pytest.raises(ValueError, match="exactly one group"):
        REWARD_MODELS.build("llm_judge", url="http://x/v1", pattern=r"\d+")


@pytest.mark.slow
def test_llm_judge_on_a_local_checkpoint_answers_as_transformers_greedy_decoding(tmp_path):
    """The judge server's answer is transformers' own greedy generation on the same prompt; llm_judge parses it."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers import make_tiny_hf_model
    from megarl.reward.models import REWARD_MODELS

    path = make_tiny_hf_model(tmp_path / "judge", "qwen2", with_tokenizer=True, seed=5)
    template = "Q {prompt} A {response} Score: "
    judge = REWARD_MODELS.build("llm_judge", checkpoint=str(path), template=template, pattern=r"(\d+)", scale=1.0,
                             max_tokens=6, timeout_s=60)
    rows = [("1+1=", "2", None), ("7-3=", "4", None)]
    try:
        results = judge.score(rows)
    finally:
        judge.close()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    for (prompt, response, _), result in zip(rows, results):
        ids = tok(template.format(prompt=prompt, response=response), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        match = re.search(r"(\d+)", text)
        if match is None:
            assert result.outcome == "parse_error" and repr(text[:80]) in result.normalized
        else:
            assert (result.score, result.extracted) == (float(match.group(1)), match.group(1))
