"""`--bf16` on a CPU: Megatron's mixed precision (bf16 params and activations in `Float16Module`, fp32 main params
in the optimizer, fp32 gradient buffers, log-probs and losses in fp32) and the built-in engine in bf16.

Tolerances are bf16's: 8 mantissa bits give a relative rounding of 2^-9 per value, and a log-prob sums many of
them; on this tiny random model the fp32 / bf16 log-prob gap measures ~3e-3 at most, the loss gap ~0.1%."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_hf_model, torchrun

from megarl.model_shape import ModelShape
from megarl.rollout.weight_sync import model_parameter_count

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/e2e/bf16_cpu_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bf16")
    hf = make_tiny_hf_model(root / "model", "qwen2")
    torchrun(1, WORKER, hf, root, timeout=300)
    return torch.load(root / "bf16.pt", weights_only=False)


def test_bf16_keeps_fp32_main_params_and_gradients(results):
    assert results["param_dtypes"] == ["torch.bfloat16"]  # the local spec's torch norms included
    assert results["main_dtypes"] == ["torch.float32"]
    assert results["main_grad_dtypes"] == ["torch.float32"]


def test_bf16_logprobs_agree_with_fp32(results):
    fp32, bf16 = results["logp"]["fp32"], results["logp"]["bf16"]
    assert bf16.dtype == torch.float32
    diff = (bf16 - fp32).abs()
    assert diff.max() < 0.02 and diff.mean() < 0.005, (diff.max(), diff.mean())


def test_bf16_training_lowers_the_loss_like_fp32(results):
    fp32, bf16 = results["losses"]["fp32"], results["losses"]["bf16"]
    assert bf16[-1] < bf16[0] - 0.1, bf16
    for a, b in zip(fp32, bf16):
        assert abs(a - b) < 0.01 * a, (fp32, bf16)


def test_bf16_engine_matches_the_bf16_actor_after_a_sync(results):
    assert results["sync"]["sync_probe_absdiff_max"] < 0.05, results["sync"]


def test_train_py_bf16_on_cpu(tmp_path):
    from megarl.tasks.arithmetic import all_problems, build_tokenizer, write_jsonl

    vocab = len(build_tokenizer()) + 1
    model = make_tiny_hf_model(tmp_path / "model", "qwen2", vocab=vocab, with_tokenizer=True)
    write_jsonl(model / "train.jsonl", all_problems()[:64])
    out = tmp_path / "run"
    torchrun(1, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", model, "--prompt-data",
             model / "train.jsonl", "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 3,
             "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--kl-coef", "0.1",
             "--bf16", "--verify-weight-sync", "--verify-sync-tolerance", "0.05", "--output-dir", out, timeout=400)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    bf16_bytes = model_parameter_count(ModelShape.from_pretrained(model)) * 2
    for r in rows:
        assert r["sync_bytes"] == bf16_bytes  # the engine receives bf16 weights
        assert r["sync_probe_absdiff_max"] < 0.05
        assert all(v == v for k, v in r.items() if isinstance(v, float)), r  # no NaN
