"""Checkpoints: model and optimizer through megatron `dist_checkpointing` (so a run saved at one TP/PP layout
loads at another), plus the trainer's own state (step, scheduler, data position, RNG states per rank).

Layout: `<dir>/iter_0000007/` holds one complete checkpoint; `<dir>/latest` names the newest complete one.
A checkpoint is written under `iter_0000007.tmp` and renamed only once every rank has finished, and `latest` is
replaced atomically after that, so a crash mid-save never damages the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megarl.config import SAVED_CONFIG, ConfigError
from megarl.mcore import cpu_compat
from megarl.mcore.convert import unwrap
from megarl.preflight import LATEST, iter_name, resolve_load

def find_latest(root: str | os.PathLike, flag: str = "--load") -> Path:
    """The newest complete checkpoint under `root`, or a ConfigError naming what is wrong."""
    path = resolve_load(str(root)) if Path(root).is_dir() else None
    if path is None:
        raise ConfigError(f"{flag} {root}: no complete checkpoint there (no '{LATEST}' file)")
    return path


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sharded_state_dict(policy, is_loading: bool) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model_sd = unwrap(policy.model).sharded_state_dict()
    # A mixture-of-experts model has two optimizers (experts and the rest) when experts are split over EP ranks,
    # one otherwise: keys without the chained optimizer's `chained_<i>.` prefix let a checkpoint saved at one EP
    # size resume at another.
    metadata = {"chained_optim_avoid_prefix": True}
    optimizers = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    if any(isinstance(o, DistributedOptimizer) for o in optimizers):
        # Megatron-LM's format for the distributed optimizer's states: megatron-core 0.16's default
        # ("fully_sharded_model_space") refuses to save at all ("ShardedTensor.flattened_range is not supported").
        # Set for the distributed optimizer only: the key also makes a chained optimizer prefix its keys.
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    optimizer_sd = policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optimizer_sd}


@cpu_compat.in_megatron_scope
def save(root: str | os.PathLike, step: int, policy, trainer_state: dict, keep_last: int = 2,
         rank_state: dict | None = None, config: dict | None = None) -> Path:
    """Collective: every rank calls it. `trainer_state` is the same on all ranks (step, data position...);
    `rank_state` is this rank's own (e.g. its dynamic-sampling buffer), saved next to its RNG states; `config`
    (the run's resolved config, `megarl.config.saved_config`) is written beside them as `config.json`.

    The policy must be on its device: in colocated mode the train loop saves after `enter_training` (actor
    onloaded) and the weight sync, never between `enter_rollout` and `enter_training`, when its weights and
    optimizer states may be offloaded (their GPU storages resized to 0 bytes) for the engine."""
    from megatron.core import dist_checkpointing

    offloader = getattr(policy, "_offloader", None)
    if offloader is not None and offloader.offloaded_bytes:
        raise RuntimeError(f"checkpoint.save: {offloader.offloaded_bytes} bytes of the policy are offloaded for the "
                           "rollout engine (--offload-optimizer / --offload-params); onload it (steps.enter_training) "
                           "before saving, or the checkpoint would hold empty storages")

    root = Path(root)
    final = root / iter_name(step)
    tmp = root / (iter_name(step) + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
        tmp.mkdir()
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(policy, is_loading=False), str(tmp))
    with open(tmp / f"rank{rank:05d}.pkl", "wb") as fh:
        pickle.dump({"rng": _rng_state(), "rank_state": rank_state or {}}, fh)
    if rank == 0:
        with open(tmp / "trainer_state.pkl", "wb") as fh:
            pickle.dump({**trainer_state, "scheduler": policy.scheduler.state_dict(), "step": step}, fh)
        if config is not None:
            (tmp / SAVED_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = root / (LATEST + ".tmp")
        marker_tmp.write_text(final.name + "\n")
        os.replace(marker_tmp, root / LATEST)
        _prune(root, keep_last, keep=final.name)
    dist.barrier()
    return final


def _prune(root: Path, keep_last: int, keep: str) -> None:
    done = sorted(p for p in root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[: max(0, len(done) - keep_last)]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def _give_states_to_distributed_optimizer(optimizer) -> None:
    """A distributed optimizer that has not stepped yet has no Adam states, and megatron-core cannot describe the
    states it is to load ("assert len(steps) == 1"): Megatron's own dummy step gives it states (zero gradients;
    the loaded checkpoint then replaces the states and the weights in place)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _restore_steps(optimizer) -> None:
    """torch's Adam counts steps per parameter (its bias correction); megatron-core saves the count once, in the
    param groups, and its distributed optimizer loads it there only: each parameter's count goes back here."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    state = opt.optimizer.state.get(p, {})
                    if "step" in group and "step" in state:
                        state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


@cpu_compat.in_megatron_scope
def load(path: str | os.PathLike, policy, *, load_optimizer: bool = True, load_rng: bool = True) -> dict:
    """Load a checkpoint saved at any TP/PP layout (the distributed optimizer's: at the same TP and PP) into `policy`;
    returns the trainer state, with this rank's own saved state under "rank_state" ({} when it has none)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if load_optimizer:
        _give_states_to_distributed_optimizer(policy.optimizer)
    sd = _sharded_state_dict(policy, is_loading=True)
    if not load_optimizer:
        sd.pop("optimizer")
    loaded = dist_checkpointing.load(sd, str(path))
    unwrap(policy.model).load_state_dict(loaded["model"])
    if load_optimizer:
        with torch.no_grad():  # the distributed optimizer copies into its fp32 main params, views of the weights
            policy.optimizer.load_state_dict(loaded["optimizer"])
        _restore_steps(policy.optimizer)
    with open(path / "trainer_state.pkl", "rb") as fh:
        state = pickle.load(fh)
    policy.scheduler.load_state_dict(state.pop("scheduler"))
    rank_file = path / f"rank{dist.get_rank():05d}.pkl"
    state["rank_state"] = {}
    if rank_file.is_file():
        with open(rank_file, "rb") as fh:
            mine = pickle.load(fh)
        if load_rng:
            _set_rng_state(mine["rng"])
        state["rank_state"] = mine.get("rank_state", {})
    return state


@cpu_compat.in_megatron_scope
def load_weights(path: str | os.PathLike, policy) -> None:
    """The model's weights only, from a checkpoint saved at any TP/PP layout (no optimizer, scheduler or RNG
    states: what an offline conversion needs)."""
    from megatron.core import dist_checkpointing

    model = unwrap(policy.model)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(loaded["model"])


HF_SHARD_BYTES = 2 << 30  # like transformers' save_pretrained default ("5GB" there; smaller shards load lazily)


def write_hf_shards(named_tensors, out_dir: str | os.PathLike, max_shard_bytes: int = HF_SHARD_BYTES) -> list[Path]:
    """Write HF-named tensors as safetensors shards of at most `max_shard_bytes` each (one tensor larger than
    that gets a shard of its own), holding one shard in host memory at a time: `model.safetensors` when one shard
    suffices, else `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` (transformers' layout).
    Returns the files written."""
    import json

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        nonlocal shard, size
        if shard:
            path = out / f"model.part{len(parts):05d}.tmp"
            save_file(shard, str(path), metadata={"format": "pt"})
            parts.append((path, list(shard)))
            shard, size = {}, 0

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(parts) == 1:
        final = [out / "model.safetensors"]
    else:
        final = [out / f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for (tmp, _), path in zip(parts, final):
        os.replace(tmp, path)
    if len(parts) > 1:
        weight_map = {name: path.name for (_, names), path in zip(parts, final) for name in names}
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return final
