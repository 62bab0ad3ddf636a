"""`megarl/train.py` end to end with every logging output on, reading its prompts from parquet, on 2 ranks (DP=2):
the console progress line, samples.jsonl, TensorBoard events, an offline wandb run and the end-of-run PNG, all
written once (rank 0)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_train_writes_every_log_output(starter, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.loads(line) for line in (starter / "train.jsonl").read_text().splitlines()[:64]]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out, tb = tmp_path / "out", tmp_path / "tb"
    monkeypatch.setenv("WANDB_SILENT", "true")
    proc = torchrun(2, "megarl/train.py", "recipes/tiny_cpu.sh", "--hf-checkpoint", starter, "--prompt-data", data,
                    "--eval-data", "", "--max-train-minutes", "0", "--num-steps", 4, "--rollout-batch-size", 4,
                    "--n-samples-per-prompt", 4, "--micro-batch-size", 8, "--output-dir", out, "--log-interval", 2,
                    "--log-samples-interval", 2, "--log-samples-count", 3, "--tensorboard-dir", tb,
                    "--wandb-project", "megarl-e2e", "--wandb-mode", "offline", timeout=400)

    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]  # once per interval, rank 0 only
    for line in lines:
        assert re.search(r"\| eta \d+m\d\ds \| reward [\d.]+ \| acc [\d.]+% \| kl [\d.]+ \| clip [\d.]+ \|", line), line
        assert re.search(r"s \(rollout [\d.]+ reward [\d.]+ \([\d.]+ exposed\) logp [\d.]+ update [\d.]+ "
                         r"sync [\d.]+\)", line), line

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m[k] >= 0 for m in metrics for k in ("t_generate", "t_reward", "t_logprobs", "t_update", "t_sync"))

    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 2, 4, 4, 4]
    prompts = {r["prompt"] for r in rows}
    assert all(s["prompt"] in prompts and s["outcome"] and isinstance(s["reward"], float) for s in samples)

    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("reward_mean")] == pytest.approx([m["reward_mean"] for m in metrics])

    run_id = (out / "wandb-run-id").read_text()
    assert len(list((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) == 1

    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"
