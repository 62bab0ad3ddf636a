"""Kill and resume with LoRA is bitwise, and a LoRA checkpoint holds the adapters and their optimizer states only.

A run of N = 4 updates straight is held against one that makes k = 2, saves, is dropped, and is resumed by a new
actor (base from the HF directory, adapters, Adam's states and the RNG states from the checkpoint; the torch RNG
is reseeded in between, as a new process would have it) for the last N - k: the per-step metrics and the adapter
tensors must be equal bit for bit. Dropout on the adapters' input (0.1) makes the RNG states part of the check.
Both optimizers: Megatron's plain one and the distributed one (whose save format differs). Then the checkpoint's
refusals: a base whose weights differ, and a model without adapters. One rank, in process (`python megarl/train.py`
at DP = 1 runs the same save and load paths; the distributed optimizer's format is that of DP > 1). The same run at
PP 2 (Qwen2, each stage's adapters) and at EP 2 (Qwen3-MoE with attention and expert adapters, DP 2 with a batch of
its own per rank) in one torchrun of this file over two processes, checked on every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
STEPS, SAVED_AT = 4, 2
MOE_TARGETS = ("q_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
LAYOUTS = {"pp2": dict(pp=2), "ep2": dict(ep=2)}  # the torchrun's, on the two processes


def test_lora_checkpoint_resumes_bitwise_and_holds_only_the_adapters(tiny_qwen2, tmp_path, process_group):
    r = run(str(tiny_qwen2), str(tmp_path))
    check_resumed(r)
    assert r["errors"]["other base"].startswith(f"{tmp_path / 'ckpt_False'}/iter_0000002: its LoRA adapters were ")
    assert "differs: model.norm.weight holds other values" in r["errors"]["other base"]
    assert "holds LoRA adapters only" in r["errors"]["no adapters"]


@pytest.mark.distributed
def test_lora_checkpoint_resumes_bitwise_at_pp2_and_ep2(tiny_qwen2, tmp_path):
    from helpers import REPO, make_tiny_hf_model, torchrun

    moe = make_tiny_hf_model(tmp_path / "qwen3_moe", "qwen3_moe", layers=2, mlp_only_layers=[1])
    torchrun(2, "tests/distributed/test_lora_resume.py", tiny_qwen2, moe, tmp_path, timeout=400,
             extra_env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])})
    for layout in LAYOUTS:
        for rank in range(2):
            r = torch.load(tmp_path / layout / f"result_{rank}.pt", weights_only=False)
            try:
                check_resumed(r)
            except AssertionError as e:
                raise AssertionError(f"{layout}, rank {rank}: {e}") from e
            if layout == "ep2":  # each EP rank saved its own experts' adapters
                assert any(".mlp.experts." in k and ".lora." in k for k in r[True]["checkpoint_keys"])
                assert sum(".mlp.experts." in n for n in r[True]["straight"]["adapters"]) == 4


def check_resumed(r: dict) -> None:
    """The resumed run equals the straight one bitwise (both optimizers); the checkpoint holds adapters only."""
    for distributed in (False, True):
        straight, resumed = r[distributed]["straight"], r[distributed]["resumed"]
        assert [m["step"] for m in resumed["metrics"]] == list(range(1, STEPS + 1))
        assert resumed["metrics"] == straight["metrics"], (  # loss, grad norm, ... bitwise
            f"use_distributed_optimizer={distributed}: the resumed run's metrics differ from the straight run's")
        assert straight["adapters"].keys() == resumed["adapters"].keys() and straight["adapters"]
        for name, t in straight["adapters"].items():
            assert torch.equal(t, resumed["adapters"][name]), f"use_distributed_optimizer={distributed}: {name}"
        moved = max((t - r[distributed]["at_save"][n]).abs().max().item() for n, t in straight["adapters"].items())
        assert moved > 1e-4, "the updates after the save must move the adapters, or the comparison says nothing"
        # The checkpoint: adapters and their Adam states, no base weight and no state for one.
        keys = r[distributed]["checkpoint_keys"]
        assert any(".lora." in k for k in keys) and any("exp_avg_sq" in k for k in keys), keys
        assert not [k for k in keys if "layers" in k and ".lora." not in k or "embedding" in k or "output" in k]


def run(hf: str, out: str, *, pp: int = 1, ep: int = 1, refusals: bool = True) -> dict:
    """The straight and resumed runs with both optimizers, in initialised process groups (TP 1, `pp`, `ep`: a
    Qwen3-MoE `hf` at EP > 1, with attention and expert adapters); every rank gets its own stage's adapters (whole
    over EP) and its own metrics. `refusals`: also try the two loads that must fail (one rank)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers import fixed_batch

    from megarl.config import ConfigError, build_config
    from megarl.mcore import checkpoint, lora
    from megatron.core import parallel_state as ps

    from megarl.mcore.actor import MegatronPolicy, OptimConfig
    from megarl.mcore.model import MoEOptions
    from megarl.model_shape import ModelShape
    from megarl.stages.update import make_loss_fn

    shape = ModelShape.from_pretrained(hf)
    loss_fn = make_loss_fn(build_config({}).algorithm, 64)
    targets = MOE_TARGETS if shape.is_moe else lora.TARGETS
    opts = lora.LoRAOptions(rank=4, alpha=8.0, dropout=0.1, seed=3, targets=targets)
    moe = MoEOptions(ep=ep, etp=1) if shape.is_moe else None
    dp_rank = ps.get_data_parallel_rank()

    def build(distributed: bool, seed: int, base: str = hf) -> MegatronPolicy:
        torch.manual_seed(seed)  # the torch RNG state a fresh process would have
        # A large Adam eps, as tests/distributed/worker.py says why: float noise must not become full-size updates.
        optim = OptimConfig(lr=1e-2, adam_eps=1e-4, weight_decay=0.1, use_distributed_optimizer=distributed)
        actor = MegatronPolicy(shape, tp=1, pp=pp, trainable=True, optim=optim, lora=opts, moe=moe)
        actor.load_hf(base)
        return actor

    def steps(actor, first: int, last: int) -> list[dict]:  # each DP rank its own batch
        return [{"step": s, **actor.train_step(fixed_batch(shape.vocab_size, s + 100 * dp_rank), loss_fn,
                                               micro_batch_size=2)} for s in range(first, last + 1)]

    result = {}
    for distributed in (False, True):
        ckpt = Path(out) / f"ckpt_{distributed}"
        actor = build(distributed, seed=0)
        straight = {"metrics": steps(actor, 1, STEPS), "adapters": lora.peft_tensors(actor.model)}
        actor = build(distributed, seed=0)
        before = steps(actor, 1, SAVED_AT)
        at_save = lora.peft_tensors(actor.model)
        checkpoint.save(ckpt, SAVED_AT, actor, {"sampler": {"epoch": 0, "position": 0}})
        del actor  # the kill
        actor = build(distributed, seed=12345)
        assert checkpoint.load(checkpoint.find_latest(ckpt), actor)["step"] == SAVED_AT
        resumed = {"metrics": before + steps(actor, SAVED_AT + 1, STEPS), "adapters": lora.peft_tensors(actor.model)}
        from megatron.core import dist_checkpointing

        keys = sorted(dist_checkpointing.load_tensors_metadata(str(checkpoint.find_latest(ckpt))))
        result[distributed] = {"straight": straight, "resumed": resumed, "at_save": at_save, "checkpoint_keys": keys}
    if not refusals:
        return result

    errors = {}
    other = Path(out) / "other_base"
    shutil.copytree(hf, other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    ckpt = checkpoint.find_latest(Path(out) / "ckpt_False")
    for what, policy in (("other base", build(False, seed=0, base=str(other))),
                         ("no adapters", MegatronPolicy(shape, tp=1, pp=1, trainable=True, optim=OptimConfig()))):
        try:
            checkpoint.load(ckpt, policy)
        except ConfigError as e:
            errors[what] = str(e)
    result["errors"] = errors
    return result


def main(qwen2: str, moe: str, out: str) -> None:
    """Under torchrun (two processes): `run` at each of `LAYOUTS`; every rank saves its result."""
    from megatron.core import parallel_state

    from megarl.mcore import parallel

    torch.set_num_threads(1)
    parallel.init_distributed(timeout_s=120, seed=0)
    for layout, split in LAYOUTS.items():
        parallel_state.destroy_model_parallel()
        parallel.init_distributed(**split, etp=1, timeout_s=120, seed=0)
        hf = moe if split.get("ep", 1) > 1 else qwen2
        result = run(hf, str(Path(out) / layout), **split, refusals=False)
        torch.save(result, Path(out) / layout / f"result_{torch.distributed.get_rank()}.pt")
    parallel.destroy()


if __name__ == "__main__":  # dist_checkpointing's save spawns helpers: keep the guard
    main(*sys.argv[1:])
