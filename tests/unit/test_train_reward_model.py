"""megarl-train-reward-model (`megarl.cli.train_reward_model`): trains a sequence-classification reward model that
HFRewardModel (and so hf_rm) loads as an ordinary HF checkpoint, with the stored normalisation its own scores give."""

from __future__ import annotations

import json
import math
import random

import pytest

from helpers import make_tiny_hf_model

import megarl.cli.train_reward_model as tool


def test_labelled_rows_train_a_reward_model_hf_rm_loads(tmp_path):
    from megarl.reward.hf_scorer import HFRewardModel

    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=1)
    rng = random.Random(0)
    rows = [{"prompt": f"{a}+{b}=", "response": ("yes" if good else "no") + str(a), "label": int(good)}
            for a in range(10) for b in range(4) for good in (rng.random() < 0.5,)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    assert tool.main(["--init", str(init), "--out", str(out), "--data", str(data), "--steps", "40", "--lr", "3e-3",
                      "--batch-size", "16"]) == 0
    rm = HFRewardModel(out)
    scores = rm.score([(r["prompt"], r["response"], None) for r in rows])
    assert sum((s > 0) == bool(r["label"]) for s, r in zip(scores, rows)) / len(rows) > 0.9, "it learned the labels"
    config = json.loads((out / "config.json").read_text())
    metrics = json.loads((out / "reward_model_eval.json").read_text())
    # The stored mean/std: the saved model's scores of the training rows (the 90% not held out), recomputed here.
    train_rows = [r for r in rows if (r["prompt"], r["response"]) not in
                  {(t["prompt"], t["response"]) for t in _held_out(rows)}]
    train_scores = rm.score([(r["prompt"], r["response"], None) for r in train_rows])
    mean = sum(train_scores) / len(train_scores)
    assert config["reward_mean"] == pytest.approx(mean, abs=1e-5) == pytest.approx(metrics["reward_mean"], abs=1e-5)
    normalised = HFRewardModel(out, normalize=True).score([(rows[0]["prompt"], rows[0]["response"], None)])[0]
    assert normalised == pytest.approx((scores[0] - config["reward_mean"]) / config["reward_std"], abs=1e-5)
    assert not (tmp_path / ".rm.partial").exists()


def test_listwise_pairs_train_a_reward_model_that_ranks_the_chosen_first(tmp_path):
    """--listwise on preference pairs: the chosen response ends up ranked first among each prompt's responses."""
    from megarl.reward.hf_scorer import HFRewardModel

    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=1)
    rows = [{"prompt": f"{a}+{b}=", "chosen": "yes" + str(a), "rejected": bad + str(a)}
            for a in range(10) for b in range(4) for bad in ("no", "maybe", "x")]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tool.main(["--init", str(init), "--out", str(tmp_path / "rm"), "--data", str(data), "--steps", "40",
                      "--lr", "3e-3", "--batch-size", "16", "--listwise", "3"]) == 0
    rm = HFRewardModel(tmp_path / "rm")
    chosen = rm.score([(r["prompt"], r["chosen"], None) for r in rows])
    rejected = rm.score([(r["prompt"], r["rejected"], None) for r in rows])
    assert sum(c > j for c, j in zip(chosen, rejected)) / len(rows) > 0.9


def test_listwise_refuses_labelled_rows(tmp_path):
    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=1)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+1=", "response": str(x), "label": int(x == 2)}) + "\n"
                            for x in range(20)))
    with pytest.raises(SystemExit, match="--listwise needs preference pairs"):
        tool.main(["--init", str(init), "--out", str(tmp_path / "rm"), "--data", str(data), "--listwise", "3"])


def test_policy_samples_come_from_policy_when_the_trunk_is_another_model(tmp_path):
    """--policy: the starter RL begins from is sampled, not the reward model's trunk (--init); without it, --init."""
    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=1)
    task = tmp_path / "task"
    task.mkdir()
    (task / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                              for a in range(6)))
    sampled = []
    tool.sampled_pairs = lambda lm, path, n, seed, subset=0: sampled.append((lm, path.name, n)) or []
    argv = ["--init", str(init), "--arithmetic", str(task), "--policy-samples", "3", "--steps", "1"]
    assert tool.main(argv + ["--out", str(tmp_path / "a"), "--policy", str(tmp_path / "policy")]) == 0
    assert sampled == [(tmp_path / "policy", "train.jsonl", 3)]
    assert tool.main(argv + ["--out", str(tmp_path / "b")]) == 0
    assert sampled[1:] == [(init, "train.jsonl", 3)]


def _held_out(rows):
    """The rows the tool sets aside: the first 10% after its seeded shuffle (seed 0)."""
    shuffled = list(rows)
    random.Random(0).shuffle(shuffled)
    return shuffled[: len(rows) // 10]


def test_bad_rows_are_named_with_their_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n{\"prompt\": 1}\n")
    with pytest.raises(SystemExit, match=r"rows.jsonl:2: expected \{prompt, chosen, rejected\}"):
        tool.read_rows(data)


def test_the_losses_by_hand():
    """Bradley-Terry on pairs, binary cross-entropy on labels, and --calibrate's BCE on both sides of a pair."""
    import math

    import torch

    scores = {"a": 2.0, "b": -1.0, "c": 0.5}

    class FakeRM:
        def token_ids(self, prompt, response):
            return [response]

        def forward_ids(self, ids):
            return torch.tensor([scores[x[0]] for x in ids])

    sig = lambda x: 1 / (1 + math.exp(-x))
    pair = {"prompt": "p", "chosen": "a", "rejected": "b"}
    labelled = {"prompt": "p", "response": "c", "label": 0}
    assert tool.loss_of(FakeRM(), [pair]).item() == pytest.approx(-math.log(sig(3.0)))
    assert tool.loss_of(FakeRM(), [pair, labelled]).item() == pytest.approx(
        (-math.log(sig(3.0)) - math.log(1 - sig(0.5))) / 2)
    assert tool.loss_of(FakeRM(), [pair], calibrate=True).item() == pytest.approx(
        -math.log(sig(3.0)) - 0.5 * (math.log(sig(2.0)) + math.log(sig(1.0))))


def test_the_listwise_loss_by_hand():
    """--listwise: -log of the right answer's softmax share among itself and its K wrong ones, averaged over the
    prompts; --calibrate adds each score's binary cross-entropy (right 1, wrong 0), summed over the K + 1, halved."""
    import torch

    scores = {"a": 2.0, "b": -1.0, "c": 0.5, "d": 1.0, "e": 0.0, "f": -2.0}

    class FakeRM:
        def token_ids(self, prompt, response):
            return [response]

        def forward_ids(self, ids):
            return torch.tensor([scores[x[0]] for x in ids])

    def ce(right, wrong):
        return -math.log(math.exp(scores[right]) / sum(math.exp(scores[x]) for x in [right, *wrong]))

    def bce(right, wrong):
        sig = lambda x: 1 / (1 + math.exp(-x))
        return -math.log(sig(scores[right])) - sum(math.log(1 - sig(scores[x])) for x in wrong)

    groups = [("p", "a", ["b", "c"]), ("q", "d", ["e", "f"])]
    assert tool.listwise_loss_of(FakeRM(), groups).item() == pytest.approx((ce("a", "bc") + ce("d", "ef")) / 2)
    assert tool.listwise_loss_of(FakeRM(), groups, calibrate=True).item() == pytest.approx(
        (ce("a", "bc") + ce("d", "ef")) / 2 + (bce("a", "bc") + bce("d", "ef")) / 4)


def test_listwise_groups_gather_each_prompts_wrong_answers():
    pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": r} for r in ("3", "1", "")] + \
        [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}, {"prompt": "1+1=", "chosen": "2", "rejected": "22"}]
    groups = tool.listwise_groups(pairs)
    assert groups == [("1+1=", "2", ["3", "1", "", "22"]), ("2+2=", "4", ["5"])]
    picked = tool.sample_groups(groups, 2, 3, random.Random(0))
    assert sorted(g[0] for g in picked) == ["1+1=", "2+2="]
    for prompt, _right, wrong in picked:
        assert len(wrong) == 3 and set(wrong) <= set(dict((g[0], g[2]) for g in groups)[prompt])
        if prompt == "1+1=":
            assert len(set(wrong)) == 3  # enough wrong answers: drawn without replacement


def test_policy_pairs_are_the_verifiers_wrong_samples_against_the_answer():
    """Each sample the verifier calls wrong (a near miss, junk after the answer, nothing) becomes one pair, repeats
    included; right samples make none."""
    problems = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "9-4=", "answer": "5"}, {"prompt": "1+1=", "answer": "2"}]
    samples = [["5", "6", "6", " 5 "], ["5x", "", "05"], ["2", "2"]]
    assert tool.policy_pairs(problems, samples) == [
        {"prompt": "2+3=", "chosen": "5", "rejected": "6"}, {"prompt": "2+3=", "chosen": "5", "rejected": "6"},
        {"prompt": "9-4=", "chosen": "5", "rejected": "5x"}, {"prompt": "9-4=", "chosen": "5", "rejected": ""},
        {"prompt": "9-4=", "chosen": "5", "rejected": "05"}]


def test_far_misses_are_wrong_by_the_verifier_and_cover_the_drifts():
    """Every far miss is a response the verifier calls wrong; they include each digit dropped, the digits reversed,
    a single digit, a leading zero, a minus sign, a stray character and a response with no digit."""
    from megarl.verifiers.arithmetic import ArithmeticVerifier

    verifier, rng = ArithmeticVerifier(), random.Random(3)
    for answer in ("0", "7", "28", "100"):
        for _ in range(20):
            misses = tool.far_misses(answer, rng)
            assert all(verifier.verify(m, answer).outcome != "correct" for m in misses), (answer, misses)
            assert "0" + answer in misses and "-" + answer in misses
            assert any(m.startswith(answer) and len(m) == len(answer) + 1 and not m[-1].isdigit() for m in misses)
            assert any(m and not any(ch.isdigit() for ch in m) for m in misses)
            assert any(len(m) == 1 and m.isdigit() for m in misses)
    misses = tool.far_misses("28", random.Random(0))
    assert {"2", "8", "82"} <= set(misses)
    assert tool.far_misses("100", random.Random(0))[:2] == ["00", "10"]  # dropped digits, in order


def test_far_negatives_add_pairs_only_when_asked(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in (3, 14)))
    near = tool.arithmetic_pairs(path, random.Random(0))
    both = tool.arithmetic_pairs(path, random.Random(0), far=True)
    assert len(near) == 2 * 8 and len(both) > len(near)
    assert all(p["chosen"] == str(2 * int(p["prompt"].split("+")[0])) for p in both)
    assert {"8", "2"} <= {p["rejected"] for p in both if p["prompt"] == "14+14="}


class _ScriptedLM:
    """A causal LM whose next token is scripted from the prompt's length and the tokens so far: prompt length L
    gives str(L) then str(L+1) ... for L tokens, then eos (or never eos when L is 5)."""

    def __init__(self, tokenizer):
        self.tok, self.calls = tokenizer, 0

    def eval(self):
        return self

    def __call__(self, input_ids, use_cache=False):
        import torch

        self.calls += 1
        vocab = len(self.tok)
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], vocab), -1e9)
        for row, ids in enumerate(input_ids.tolist()):
            prompt_len = next(k for k in range(1, len(ids) + 1) if self.tok.decode(ids[:k]).endswith("="))
            made = len(ids) - prompt_len
            digit = str((prompt_len + made) % 10)
            nxt = self.tok.eos_token_id if made >= prompt_len and prompt_len != 5 else \
                self.tok(digit, add_special_tokens=False)["input_ids"][0]
            logits[row, -1, nxt] = 0.0
        return type("Out", (), {"logits": logits})


def test_sample_responses_keep_the_prompts_order_and_stop_at_eos(tmp_path):
    from transformers import AutoTokenizer

    from megarl.tasks.arithmetic import build_tokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    prompts = ["12+3=", "1+2=", "10+20=", "2+2="]  # lengths 5, 4, 6, 4: three length groups, out of order
    out = tool.sample_responses(_ScriptedLM(tok), tok, prompts, n=2, seed=0, max_new_tokens=7)
    assert out == [["5678901"] * 2, ["4567"] * 2, ["678901"] * 2, ["4567"] * 2]


def test_added_layers_start_as_the_init_trunk(tmp_path):
    """--add-layers N: N new decoder layers on top whose output projections are zero, so the deeper reward model
    scores every text as the plain one does (given the same head) until training moves them; it loads as an ordinary
    checkpoint with N more layers."""
    import torch

    from megarl.reward.hf_scorer import HFRewardModel

    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=3)
    torch.manual_seed(0)
    tool.init_model(init, tmp_path / "plain")
    torch.manual_seed(0)
    tool.init_model(init, tmp_path / "deeper", add_layers=2)
    plain, deeper = HFRewardModel(tmp_path / "plain"), HFRewardModel(tmp_path / "deeper")
    with torch.no_grad():  # the heads are drawn from different points of the random stream: make them equal
        deeper.model.score.weight.copy_(plain.model.score.weight)
    assert deeper.model.config.num_hidden_layers == plain.model.config.num_hidden_layers + 2
    rows = [("12+34=", "46", None), ("3-7=", "", None), ("50+50=", "100", None)]
    assert deeper.score(rows) == pytest.approx(plain.score(rows), abs=1e-5)


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    assert tool.learning_rate_factor(0, 100) == pytest.approx(1.0)  # no warm-up: the default, as before
    assert tool.learning_rate_factor(0, 100, warmup=10) == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0))))
    assert tool.learning_rate_factor(100, 100, warmup=10) == pytest.approx(0.1)


def test_freeze_init_needs_added_layers(tmp_path):
    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=1)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}=", "chosen": "1", "rejected": "2"}) + "\n" for a in range(20)))
    with pytest.raises(SystemExit, match="--freeze-init needs --add-layers"):
        tool.main(["--init", str(init), "--out", str(tmp_path / "rm"), "--data", str(data), "--steps", "1",
                   "--freeze-init"])


def test_freeze_init_trains_only_the_added_layers_and_the_head(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    init = make_tiny_hf_model(tmp_path / "init", "qwen2", with_tokenizer=True, seed=1)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)})
                            + "\n" for a in range(6) for b in range(6)))
    out = tmp_path / "rm"
    assert tool.main(["--init", str(init), "--out", str(out), "--data", str(data), "--steps", "3", "--lr", "1e-2",
                      "--add-layers", "1", "--freeze-init"]) == 0
    before = AutoModelForSequenceClassification.from_pretrained(str(init), num_labels=1).state_dict()
    after = AutoModelForSequenceClassification.from_pretrained(str(out), num_labels=1).state_dict()
    assert after["model.layers.2.mlp.down_proj.weight"].abs().sum() > 0, "the added layer trained"
    for name, value in before.items():
        if name.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.")):
            assert torch.equal(value, after[name]), name
