"""The colocation cycle through `megarl/train.py` on CPU: offloading the actor between updates (and the frozen
reference outside its log-probs) and checking each weight sync changes nothing about training, and every sync
moves exactly the model's parameter bytes.

A random tiny model gets no reward on arithmetic, so weight decay and a KL term make the actor move (the syncs
carry changed weights, and the losses of steps 2-3 are not zero)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_tiny_hf_model, torchrun

from megarl.model_shape import ModelShape
from megarl.rollout.weight_sync import model_parameter_count

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TRAIN = "megarl/train.py"
COMPARED = ("reward_mean", "loss", "grad_norm", "response_len", "kl")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from megarl.tasks.arithmetic import all_problems, build_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("cycle")
    vocab = len(build_tokenizer()) + 1  # even, for TP=2
    path = make_tiny_hf_model(root / "model", "qwen2", vocab=vocab, with_tokenizer=True)
    write_jsonl(path / "train.jsonl", all_problems()[:64])
    return path


def _run(model: Path, out: Path, nproc: int, *extra) -> dict[int, dict]:
    proc = torchrun(nproc, TRAIN, "recipes/tiny_cpu.sh", "--hf-checkpoint", model, "--prompt-data",
                    model / "train.jsonl", "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 3,
                    "--rollout-batch-size", 4, "--n-samples-per-prompt", 4, "--micro-batch-size", 16, "--lr", "1e-2",
                    "--weight-decay", "0.1", "--kl-coef", "0.1", "--output-dir", out, *extra, timeout=400)
    (out / "stdout.txt").write_text(proc.stdout)
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_offload_and_verified_sync_leave_training_unchanged(model, tmp_path):
    plain = _run(model, tmp_path / "plain", 1)
    cycled = _run(model, tmp_path / "cycled", 1, "--offload-optimizer", "--offload-params", "--offload-frozen",
                  "--verify-weight-sync", "--verify-sync-tolerance", "1e-4", "--sync-bucket-mb", 1)
    assert plain[3]["loss"] != 0.0, "all-zero losses would make the comparison vacuous"
    # --offload-frozen moved the reference (--kl-coef 0.1) off and back every step: all its fp32 bytes
    reference_mib = model_parameter_count(ModelShape.from_pretrained(model)) * 4 / 2**20
    assert (f"--offload-frozen: 1 frozen model(s), {reference_mib:.1f} MiB on rank 0"
            in (tmp_path / "cycled" / "stdout.txt").read_text())
    param_bytes = model_parameter_count(ModelShape.from_pretrained(model)) * 4  # fp32
    for step in (1, 2, 3):
        for key in COMPARED:
            assert cycled[step][key] == plain[step][key], (step, key)  # bitwise: offload restores every byte
        assert cycled[step]["weight_version"] == step
        assert cycled[step]["sync_bytes"] == plain[step]["sync_bytes"] == param_bytes, "each parameter moves once"
        assert cycled[step]["sync_probe_absdiff_max"] < 1e-4


def test_verified_sync_at_tp2(model, tmp_path):
    rows = _run(model, tmp_path / "tp2", 2, "--tensor-model-parallel-size", 2, "--verify-weight-sync",
                "--verify-sync-tolerance", "1e-4")
    param_bytes = model_parameter_count(ModelShape.from_pretrained(model)) * 4
    assert all(rows[s]["sync_bytes"] == param_bytes and rows[s]["sync_probe_absdiff_max"] < 1e-4 for s in rows)


def test_a_checkpoint_saved_after_the_push_resumes_exactly(model, tmp_path):
    """With --offload-optimizer the optimizer state leaves the GPU before the push (`free_for_push`), and train.py
    saves after the push: the checkpoint must still hold it, so the resumed run repeats the uninterrupted one."""
    import shutil

    flags = ("--offload-optimizer", "--offload-params", "--save-interval", 2)
    full = _run(model, tmp_path / "full", 1, *flags, "--save", tmp_path / "ckpt")
    at_step2 = tmp_path / "at_step2"
    shutil.copytree(tmp_path / "ckpt" / "iter_0000002", at_step2 / "iter_0000002")
    (at_step2 / "latest").write_text("iter_0000002\n")
    resumed = _run(model, tmp_path / "resumed", 1, *flags, "--load", at_step2)
    assert sorted(resumed) == [3] and full[3]["loss"] != 0.0
    for key in COMPARED:
        assert resumed[3][key] == full[3][key], key
