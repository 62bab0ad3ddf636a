"""tools/train_reward_model.py: trains a sequence-classification reward model that HFRewardModel (and so hf_rm)
loads as an ordinary HF checkpoint, with the stored normalisation its own scores give."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from helpers import REPO, make_tiny_hf_model


def _tool():
    spec = importlib.util.spec_from_file_location("train_reward_model", REPO / "tools" / "train_reward_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_labelled_rows_train_a_reward_model_hf_rm_loads(tmp_path):
    from megarl.reward_model import HFRewardModel

    tool = _tool()
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


def _held_out(rows):
    """The rows the tool sets aside: the first 10% after its seeded shuffle (seed 0)."""
    shuffled = list(rows)
    random.Random(0).shuffle(shuffled)
    return shuffled[: len(rows) // 10]


def test_bad_rows_are_named_with_their_line(tmp_path):
    tool = _tool()
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n{\"prompt\": 1}\n")
    with pytest.raises(SystemExit, match=r"rows.jsonl:2: expected \{prompt, chosen, rejected\}"):
        tool.read_rows(data)


def test_the_losses_by_hand():
    """Bradley-Terry on pairs, binary cross-entropy on labels, and --calibrate's BCE on both sides of a pair."""
    import math

    import torch

    tool = _tool()
    scores = {"a": 2.0, "b": -1.0, "c": 0.5}

    class FakeRM:
        def token_ids(self, prompt, response):
            return [response]

        def forward_ids(self, ids):
            return torch.tensor([scores[x[0]] for x in ids])

    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    pair = {"prompt": "p", "chosen": "a", "rejected": "b"}
    labelled = {"prompt": "p", "response": "c", "label": 0}
    assert tool.loss_of(FakeRM(), [pair]).item() == pytest.approx(-math.log(sig(3.0)))
    assert tool.loss_of(FakeRM(), [pair, labelled]).item() == pytest.approx(
        (-math.log(sig(3.0)) - math.log(1 - sig(0.5))) / 2)
    assert tool.loss_of(FakeRM(), [pair], calibrate=True).item() == pytest.approx(
        -math.log(sig(3.0)) - 0.5 * (math.log(sig(2.0)) + math.log(sig(1.0))))
