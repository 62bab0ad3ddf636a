"""`--use-distributed-optimizer` checkpoints save and resume exactly: an actor moved by 2 updates is saved and makes
a third update; a new actor loaded from the checkpoint makes the same third update and must reach the same
weights, bit for bit (Adam's moments and its step count, the bias correction, matter). One process (DP = 1), as
`python megarl/train.py` runs: the distributed optimizer's save format and load path are those of DP > 1, at a
fraction of a torchrun's start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def test_distributed_optimizer_checkpoint_resumes_bitwise(tiny_qwen2, tmp_path):
    from helpers import REPO, env, free_port

    subprocess.run([sys.executable, __file__, str(tiny_qwen2), str(tmp_path / "ckpt"), str(tmp_path)], check=True,
                   env={**env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}, timeout=300)
    r = torch.load(tmp_path / "result.pt")
    moved = max((r["continued"][k] - r["saved"][k]).abs().max().item() for k in r["saved"])
    assert moved > 1e-4, "the third update must change the weights, or the comparison says nothing"
    assert r["continued"].keys() == r["resumed"].keys()
    for k in r["continued"]:
        assert torch.equal(r["continued"][k], r["resumed"][k]), k


def main(hf: str, ckpt: str, out: str) -> None:
    from helpers import fixed_batch  # (the test puts tests/ on this script's PYTHONPATH)

    from megarl.config import build_config
    from megarl.mcore import checkpoint, parallel
    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.model_shape import ModelShape
    from megarl.stages.update import make_loss_fn

    torch.set_num_threads(1)
    parallel.init_distributed(timeout_s=120)
    shape = ModelShape.from_pretrained(hf)
    loss_fn = make_loss_fn(build_config({}).algorithm, 64)

    def build():
        # A large Adam eps, as tests/distributed/worker.py says why: float noise must not become full-size updates.
        optim = OptimConfig(lr=1e-2, adam_eps=1e-4, weight_decay=0.1, use_distributed_optimizer=True)
        return MegatronPolicy(shape, tp=1, pp=1, trainable=True, optim=optim)

    def update(actor, seed):
        actor.train_step(fixed_batch(shape.vocab_size, seed), loss_fn, micro_batch_size=2)
        return {k: v.clone() for k, v in actor.export_hf()}

    actor = build()
    actor.load_hf(hf)
    update(actor, 1)
    saved = update(actor, 2)
    checkpoint.save(ckpt, 2, actor, {"sampler": {"epoch": 0, "position": 0}})
    continued = update(actor, 3)
    resumed = build()
    assert checkpoint.load(checkpoint.find_latest(ckpt), resumed)["step"] == 2
    torch.save({"saved": saved, "continued": continued, "resumed": update(resumed, 3)}, Path(out) / "result.pt")
    parallel.destroy()


if __name__ == "__main__":  # dist_checkpointing's save spawns helpers: keep the guard
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
