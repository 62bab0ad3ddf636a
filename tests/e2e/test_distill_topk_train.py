"""`--teacher DIR --distill-topk 4` through `megarl/train.py`: two steps on DP 2 with a tiny random teacher on the
starter's tokenizer, with the full and the chunked log-prob head; the top-K KL reaches the loss and the metrics
(with --distill-only it is the whole loss)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import make_tiny_hf_model, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("chunk", [0, 16], ids=["full_head", "chunked_head"])
def test_two_steps_with_a_topk_teacher(starter, tmp_path, chunk):
    teacher = make_tiny_hf_model(tmp_path / "teacher", "qwen2", seed=5, vocab=80, hidden_size=96,
                                 intermediate_size=192, with_tokenizer=True)
    out = tmp_path / "run"
    coef = 0.1
    torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data",
             starter / "train.jsonl", "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 2,
             "--rollout-batch-size", 4, "--output-dir", out, "--teacher", teacher, "--distill-coef", coef,
             "--distill-topk", 4, "--distill-only", "--logprob-chunk-tokens", chunk, timeout=400)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["distill/topk_kl"]) and r["distill/topk_kl"] > 0
        # --distill-only: the advantages are 0 and the recipe has no KL or entropy term, so the token-mean loss is
        # the weighted top-K KL alone
        assert r["loss"] == pytest.approx(coef * r["distill/topk_kl"], rel=1e-5)
        assert "distill/reverse_kl" in r
