"""Run logging: the console line, samples.jsonl, TensorBoard and wandb (offline) sinks, the end-of-run figure."""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from megarl.config import LoggingConfig
from megarl.metrics import (MetricsLog, eta_seconds, format_step, held_out_curve, open_sinks, plot_run,
                            rollout_sample_rows)

TIMINGS = {"t_generate": 0.5, "t_reward": 0.01, "t_logprobs": 0.2, "t_update": 0.7, "t_sync": 0.05}


def make_row(step: int, **extra) -> dict:
    return {"step": step, "reward_mean": 0.1 * step, "accuracy": 0.05 * step, "kl": 0.001 * step, "clip_frac": 0.02,
            "response_len": 5.0 + step, "loss": -0.1, "step_seconds": 1.5, "tokens_per_second": 420.0,
            **TIMINGS, **extra}


# -- console line ----------------------------------------------------------------------------------------------


def test_format_step_has_every_field_and_phase():
    line = format_step(make_row(3, entropy=1.25), num_steps=100, eta=3725.0)
    assert line.startswith("step   3/100 | eta 1h02m | reward 0.300 | acc 15.0% | kl 0.0030 | clip 0.020 | ent 1.250")
    assert "len 8.0" in line
    assert "1.50 s (rollout 0.50 reward 0.01 logp 0.20 update 0.70 sync 0.05)" in line
    assert line.endswith("420 tok/s")


def test_format_step_skips_what_the_row_lacks():
    row = make_row(1)
    del row["t_sync"], row["clip_frac"]
    line = format_step(row, num_steps=5)
    assert "ent " not in line and "eta" not in line and "clip" not in line and "sync" not in line
    assert "rollout 0.50" in line
    assert format_step({"step": 2}, num_steps=5) == "step 2/5"


def test_eta_uses_the_run_pace_and_the_time_budget():
    assert eta_seconds(10.0, steps_done=5, steps_left=20) == pytest.approx(40.0)
    assert eta_seconds(10.0, steps_done=5, steps_left=20, time_left=25.0) == pytest.approx(25.0)
    assert eta_seconds(10.0, steps_done=5, steps_left=20, time_left=-3.0) == 0.0
    assert eta_seconds(0.0, steps_done=0, steps_left=20) is None


# -- samples ---------------------------------------------------------------------------------------------------


def sample(prompt_index, text, reward, outcome, response_ids):
    from megarl.samples import Sample, SampleStatus

    return Sample(group=0, prompt_index=prompt_index, prompt_ids=[1], response_ids=response_ids,
                  loss_mask=[1] * len(response_ids), rollout_logprobs=[0.0] * len(response_ids), weight_version=4,
                  status=SampleStatus.COMPLETED, response_text=text, reward=reward, outcome=outcome)


def batch_of(samples, advantages):
    """The step's TrainBatch as far as the sample rows read it: final rewards, advantages, the loss mask."""
    from megarl.samples import TrainBatch

    n = len(samples)
    adv = torch.tensor(advantages)
    return TrainBatch(tokens=torch.zeros(n, 4, dtype=torch.long), loss_mask=torch.ones(n, 3),
                      rollout_logp=torch.zeros(n, 3), lengths=torch.full((n,), 4),
                      rewards=torch.tensor([s.reward for s in samples]), advantages=adv)


@dataclass
class FakePrompt:
    prompt: str
    label: str = "2"
    verifier: str = "arithmetic"


def samples_and_prompts():
    prompts = [FakePrompt("1+1="), FakePrompt("2+3=")]
    samples = [sample(1, "5", 1.0, "correct", [7, 0]), sample(1, "6", 0.0, "wrong", [8, 0]),
               sample(0, "2", 1.0, "correct", [4, 0])]
    return samples, prompts, batch_of(samples, [0.7, -0.7, 0.0])


def test_samples_rows_and_file(tmp_path):
    samples, prompts, batch = samples_and_prompts()
    rows = rollout_sample_rows(10, samples, prompts, limit=2, batch=batch)
    assert [(r["prompt"], r["response"], r["reward"], r["outcome"]) for r in rows] == [
        ("2+3=", "5", 1.0, "correct"), ("2+3=", "6", 0.0, "wrong")]
    assert rows[0]["step"] == 10 and rows[0]["advantage"] == pytest.approx(0.7) and rows[0]["response_len"] == 2
    assert rows[0]["status"] == "completed" and rows[0]["weight_version"] == 4
    # Per-token advantages [B, T]: each row gets their mean over its loss mask.
    tokens = replace(batch_of(samples, [[0.5, 1.0, 9.0], [2.0, 2.0, 9.0], [0.0, 0.0, 9.0]]),
                     loss_mask=torch.tensor([[1.0, 1.0, 0.0]] * 3))
    assert [r["advantage"] for r in rollout_sample_rows(10, samples, prompts, 3, tokens)] == [0.75, 2.0, 0.0]

    log = MetricsLog(str(tmp_path), enabled=True)
    log.write_samples(10, rows)
    log.write_samples(20, rollout_sample_rows(20, samples, prompts, limit=8, batch=batch))
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 10, 20, 20, 20]
    assert lines[-1]["prompt"] == "1+1=" and lines[-1]["response"] == "2"
    # A resumed run appends; a fresh one moves the earlier file aside.
    MetricsLog(str(tmp_path), enabled=True, resumed=True).write_samples(30, rows)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 7
    MetricsLog(str(tmp_path), enabled=True)
    assert not (tmp_path / "samples.jsonl").exists()
    assert len(list(tmp_path.glob("samples.*.jsonl"))) == 1


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(str(tmp_path / "out"), enabled=False)
    log.write(make_row(1))
    log.write_samples(1, [{"step": 1}])
    assert not (tmp_path / "out").exists()


# -- TensorBoard -----------------------------------------------------------------------------------------------


def test_tensorboard_event_file_holds_the_scalars_and_samples(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    cfg = LoggingConfig(output_dir=str(tmp_path / "out"), tensorboard_dir=str(tb))
    log = MetricsLog(cfg.output_dir, enabled=True, sinks=open_sinks(cfg, cfg.output_dir, {}, resumed=False))
    for step in (1, 2, 3):
        log.write(make_row(step))
    samples, prompts, batch = samples_and_prompts()
    log.write_samples(3, rollout_sample_rows(3, samples, prompts, limit=3, batch=batch))
    log.close()

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"reward_mean", "accuracy", "kl", "response_len", "t_generate", "t_update", "t_sync"} <= set(tags["scalars"])
    assert "step" not in tags["scalars"] and "time" not in tags["scalars"]
    reward = acc.Scalars("reward_mean")
    assert [e.step for e in reward] == [1, 2, 3]
    assert [e.value for e in reward] == pytest.approx([0.1, 0.2, 0.3])
    assert [e.value for e in acc.Scalars("t_update")] == pytest.approx([0.7] * 3)
    (text,) = acc.Tensors("rollout_samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 3 and "| 2+3= | 5 | 1.000 | correct |" in table


# -- wandb -----------------------------------------------------------------------------------------------------


def read_wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline `.wandb` file: a leveldb-style log (32 KiB blocks of records with a 7-byte
    header: crc32, length, type; 1 = full, 2-4 = first/middle/last fragment) of protobuf `Record`s after a
    7-byte W&B header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks, buf = run_file.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a header: zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            break
        buf += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            chunks.append(buf)
            buf = b""
    history = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    out = tmp_path / "out"
    cfg = LoggingConfig(output_dir=str(out), wandb_project="megarl-test", wandb_mode="offline")
    log = MetricsLog(cfg.output_dir, enabled=True, sinks=open_sinks(cfg, cfg.output_dir, {"lr": 1e-4}, resumed=False))
    for step in (1, 2):
        log.write(make_row(step))
    samples, prompts, batch = samples_and_prompts()
    log.write_samples(2, rollout_sample_rows(2, samples, prompts, limit=3, batch=batch))
    log.close()

    run_id = (out / "wandb-run-id").read_text()
    (run_file,) = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history = read_wandb_history(run_file)
    assert [h["_step"] for h in history] == [1, 2]
    assert [h["reward_mean"] for h in history] == pytest.approx([0.1, 0.2])
    assert history[1]["t_update"] == pytest.approx(0.7) and "time" not in history[0]
    (table_file,) = run_file.parent.glob("files/media/table/rollout_samples_2_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "response", "reward", "outcome", "advantage"]
    assert table["data"][0][:5] == [2, "2+3=", "5", 1.0, "correct"] and table["data"][0][5] == pytest.approx(0.7)

    # A resumed megarl run continues the same wandb run.
    resumed = open_sinks(cfg, cfg.output_dir, {}, resumed=True)
    assert resumed[0].run.id == run_id
    resumed[0].close()


def test_missing_wandb_and_tensorboard_warn_and_continue(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = LoggingConfig(output_dir=str(tmp_path), wandb_project="p", wandb_mode="offline",
                        tensorboard_dir=str(tmp_path))
    assert open_sinks(cfg, cfg.output_dir, {}, resumed=False) == []
    err = capsys.readouterr().err
    assert "--wandb-project needs the wandb package" in err and "continuing without wandb" in err
    assert "--tensorboard-dir needs the tensorboard package" in err


def test_wandb_that_cannot_start_is_a_config_error(tmp_path, monkeypatch):
    import types

    from megarl.config import ConfigError

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = LoggingConfig(output_dir=str(tmp_path), wandb_project="p", wandb_mode="online")
    with pytest.raises(ConfigError, match=r"--wandb-project p: wandb could not start a run \(RuntimeError: api_key "
                                          r"not configured \(no-tty\)\); run `wandb login`, "
                                          r"or use --wandb-mode offline"):
        open_sinks(cfg, cfg.output_dir, {}, resumed=False)


def test_disabled_wandb_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = LoggingConfig(output_dir=str(tmp_path), wandb_project="p", wandb_mode="disabled")
    assert open_sinks(cfg, cfg.output_dir, {}, resumed=False) == []


# -- the figure ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_plot_run_writes_one_png_with_and_without_optional_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [make_row(s) for s in range(1, 30)]
    rows[9].update(eval_sampled=0.4, eval_greedy=0.6)  # an --eval-interval evaluation after step 10
    curve = held_out_curve(rows, {"sampled": 0.2, "greedy": 0.5}, {"sampled": 0.6, "greedy": 0.7}, 29)
    assert curve == [(0, 0.2, 0.5), (10, 0.4, 0.6), (29, 0.6, 0.7)]
    for kl in (True, False):  # without a reference the third panel shows the entropy
        png = plot_run(rows, tmp_path / f"training-{kl}.png", curve, kl=kl)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sparse = [{"step": s, "reward_mean": 0.1} for s in range(1, 4)]  # no accuracy, KL, length or timings
    assert plot_run(sparse, tmp_path / "sparse.png").stat().st_size > 0
