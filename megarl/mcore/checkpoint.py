"""Checkpoints: model and optimizer through megatron `dist_checkpointing` (so a run saved at one TP/PP layout
loads at another), plus the trainer's own state (step, scheduler, data position, RNG states per rank).

With LoRA (`--lora-rank`) a checkpoint holds the adapters and their optimizer states only: the frozen base weights
are the `--hf-checkpoint` ones, read again on resume (`load_hf` before `load`). So that a resume cannot put the
adapters on another base, the checkpoint records the base's fingerprint (`lora_base.json`: every HF tensor's dtype,
shape and CRC-32) and `load` refuses a base that differs.

Layout: `<dir>/iter_0000007/` holds one complete checkpoint; `<dir>/latest` names the newest complete one.
A checkpoint is written under `iter_0000007.tmp`, given its manifest (`manifest.json`, every file and its size)
and renamed only once every rank has finished, and `latest` is replaced atomically after that, so a crash mid-save
never damages the last good checkpoint. A save that fails on any rank (a full disk, an unwritable directory) fails
on every rank with a `CheckpointError` naming the path and the cause; its partial files are removed, and nothing
older is pruned.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import struct
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megarl import faults
from megarl.checkpoint_layout import LATEST, SAVED_CONFIG, iter_name, resolve_load, write_manifest
from megarl.errors import CheckpointError, ConfigError
from megarl.mcore import cpu_compat
from megarl.mcore.convert import is_adapter_param, unwrap

LORA_BASE = "lora_base.json"  # a LoRA checkpoint's record of the base weights it was trained on

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


def _model_sharded_state_dict(policy) -> dict:
    """The model's checkpoint entries; with LoRA the adapters' only (the base is frozen and comes from its HF
    directory, and the optimizer, which holds the adapters only, finds its parameters among these)."""
    sd = unwrap(policy.model).sharded_state_dict()
    if policy.lora is not None:
        sd = {k: v for k, v in sd.items() if is_adapter_param(k)}
    return sd


def _sharded_state_dict(policy, is_loading: bool) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model_sd = _model_sharded_state_dict(policy)
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

    offloader = policy._offloader  # `MegatronModel`'s: None until it first offloads
    if offloader is not None and offloader.offloaded_bytes:
        raise RuntimeError(f"checkpoint.save: {offloader.offloaded_bytes} bytes of the policy are offloaded for the "
                           "rollout engine (--offload-optimizer / --offload-params); onload it (steps.enter_training) "
                           "before saving, or the checkpoint would hold empty storages")

    root = Path(root)
    final = root / iter_name(step)
    tmp = root / (iter_name(step) + ".tmp")
    rank = dist.get_rank()
    failure = ""
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
            tmp.mkdir()
        except OSError as e:
            failure = _cause(e, tmp)
    _agree(failure, root, tmp, step)
    try:
        dist_checkpointing.save(_sharded_state_dict(policy, is_loading=False), str(tmp))
        with open(tmp / f"rank{rank:05d}.pkl", "wb") as fh:
            pickle.dump({"rng": _rng_state(), "rank_state": rank_state or {}}, fh)
        if rank == 0:
            with open(tmp / "trainer_state.pkl", "wb") as fh:
                pickle.dump({**trainer_state, "scheduler": policy.scheduler.state_dict(), "step": step}, fh)
            if config is not None:
                (tmp / SAVED_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
            if policy.lora is not None:
                write_lora_base(tmp, policy)
        faults.fire("disk_full_on_save", step)
    except Exception as e:  # noqa: BLE001 - whatever stopped the writing, every rank must hear of it (no hang)
        failure = _cause(e, tmp)
    _agree(failure, root, tmp, step)
    faults.fire("kill_during_save", step)  # every file written, nothing published
    if rank == 0:
        try:
            write_manifest(tmp, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = root / (LATEST + ".tmp")
            marker_tmp.write_text(final.name + "\n")
            os.replace(marker_tmp, root / LATEST)
        except OSError as e:
            failure = _cause(e, tmp)
    _agree(failure, root, tmp, step)
    if rank == 0:
        _prune(root, keep_last, keep=final.name)
    dist.barrier()
    return final


def _cause(e: BaseException, tmp: Path) -> str:
    where = getattr(e, "filename", None) or tmp
    what = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return f"rank {dist.get_rank()}: {where}: {type(e).__name__}: {what}"


def _agree(failure: str, root: Path, tmp: Path, step: int) -> None:
    """Collective: raise the same CheckpointError on every rank when any rank failed (its partial files removed,
    the earlier checkpoints untouched); else return."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failure)
    failures = [f for f in everyone if f]
    if not failures:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    marker = root / LATEST
    intact = marker.read_text().strip() if marker.is_file() else ""
    raise CheckpointError(
        f"the checkpoint of step {step} could not be saved under --save {root}: {'; '.join(failures)}. Nothing was "
        f"published and nothing pruned: " + (f"{root / intact} is intact" if intact else "there is no earlier "
                                               "checkpoint") + f". Free space or fix {root}, then resume with --load")


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


def _load_model_state(policy, state: dict) -> None:
    """Into the model; with LoRA the state holds every adapter (dist_checkpointing found each one) and no base."""
    model = unwrap(policy.model)
    if policy.lora is None:
        model.load_state_dict(state)
        return
    params = dict(model.named_parameters())
    adapters = {k for k in params if is_adapter_param(k)}
    if state.keys() != adapters:
        raise RuntimeError(f"LoRA checkpoint entries {sorted(state.keys() ^ adapters)[:3]} do not match the "
                           "model's adapters")
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v)


@cpu_compat.in_megatron_scope
def load(path: str | os.PathLike, policy, *, load_optimizer: bool = True, load_rng: bool = True) -> dict:
    """Load a checkpoint saved at any TP/PP layout (the distributed optimizer's: at the same TP and PP) into `policy`;
    returns the trainer state, with this rank's own saved state under "rank_state" ({} when it has none)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    check_lora_base(path, policy)
    if (path / LORA_BASE).is_file() and not (path / "trainer_state.pkl").is_file():
        raise ConfigError(f"{path} holds LoRA adapters only, no training state (megarl-convert-checkpoint "
                          "--from-peft writes such checkpoints): start a run from it with --lora-checkpoint, not "
                          "--load")
    if load_optimizer:
        _give_states_to_distributed_optimizer(policy.optimizer)
    sd = _sharded_state_dict(policy, is_loading=True)
    if not load_optimizer:
        sd.pop("optimizer")
    loaded = dist_checkpointing.load(sd, str(path))
    _load_model_state(policy, loaded["model"])
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
    states: what an offline conversion needs). With LoRA: the adapters, on a base already loaded (`load_hf`)."""
    from megatron.core import dist_checkpointing

    check_lora_base(path, policy)
    loaded = dist_checkpointing.load({"model": _model_sharded_state_dict(policy)}, str(path))
    _load_model_state(policy, loaded["model"])


def _file_stamps(hf_dir: str) -> tuple:
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(hf_dir).glob("*.safetensors")))


def base_fingerprint(hf_dir: str | os.PathLike) -> dict[str, list]:
    """Every tensor of the HF checkpoint at `hf_dir`: name -> [dtype, shape, CRC-32 of its bytes], read from the
    safetensors files directly (the same weights in other files or another order have the same fingerprint).
    Cached per directory while its files are unchanged: a run that saves every step reads the base once."""
    return _fingerprint(str(Path(hf_dir).resolve()), _file_stamps(hf_dir))


@lru_cache(maxsize=4)
def _fingerprint(hf_dir: str, stamps: tuple) -> dict[str, list]:
    out = {}
    for name, _, _ in stamps:
        with open(Path(hf_dir) / name, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            for key, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = meta["data_offsets"]
                fh.seek(8 + size + begin)
                crc, left = 0, end - begin
                while left:
                    chunk = fh.read(min(left, 64 << 20))
                    crc, left = zlib.crc32(chunk, crc), left - len(chunk)
                out[key] = [meta["dtype"], list(meta["shape"]), crc]
    return out


def _base_of(policy) -> str:
    if not policy.base_checkpoint:
        raise RuntimeError("a LoRA checkpoint needs the actor's base weights loaded from an HF checkpoint first "
                           "(MegatronPolicy.load_hf): it records or checks their fingerprint")
    return policy.base_checkpoint


def write_lora_base(ckpt_dir: Path, policy) -> None:
    """`lora_base.json` in `ckpt_dir`: where the base came from, and its fingerprint (rank 0 calls it)."""
    base, opts = _base_of(policy), policy.lora
    record = {"hf_checkpoint": base, "lora": _lora_record(opts), "tensors": base_fingerprint(base)}
    (Path(ckpt_dir) / LORA_BASE).write_text(json.dumps(record) + "\n")


def _lora_record(opts) -> dict:
    """The adapters' settings a checkpoint must share with the model that loads it."""
    return {"rank": opts.rank, "alpha": opts.alpha or opts.rank, "targets": sorted(opts.targets)}


def _base_difference(saved: dict, now: dict) -> str:
    """'' when equal, else the first difference in words."""
    if missing := sorted(saved.keys() - now.keys()):
        return f"it has no tensor {missing[0]}"
    if extra := sorted(now.keys() - saved.keys()):
        return f"its tensor {extra[0]} was not in the base"
    for name in sorted(saved):
        (dt0, sh0, crc0), (dt1, sh1, crc1) = saved[name], now[name]
        if (dt0, sh0) != (dt1, sh1):
            return f"{name} is {dt1} {sh1}, the base's was {dt0} {sh0}"
        if crc0 != crc1:
            return f"{name} holds other values (CRC-32 {crc1:08x}, the base's {crc0:08x})"
    return ""


def check_lora_base(path: Path, policy) -> None:
    """Collective. A checkpoint and a policy agree on LoRA, and a LoRA checkpoint's base is the policy's (the
    fingerprints of `lora_base.json` and of the HF directory the policy loaded, compared on rank 0); else a
    ConfigError on every rank that names the difference."""
    record = path / LORA_BASE
    lora_opts = policy.lora
    if lora_opts is None:
        if record.is_file():
            raise ConfigError(f"{path} holds LoRA adapters only (saved with --lora-rank): load it with the same "
                              "--lora-rank and --lora-target-modules")
        return
    if not record.is_file():
        raise ConfigError(f"{path} holds no LoRA adapters (no {LORA_BASE}: saved without --lora-rank, or before "
                          f"megarl's LoRA checkpoints held the adapters only); this run has --lora-rank "
                          f"{lora_opts.rank}")
    base = _base_of(policy)
    saved = json.loads(record.read_text())
    if saved["lora"] != _lora_record(lora_opts):
        raise ConfigError(f"{path} holds adapters of {saved['lora']}; this run's are {_lora_record(lora_opts)}: "
                          "set --lora-rank, --lora-alpha and --lora-target-modules as they were saved")
    why = [""]
    if dist.get_rank() == 0:
        if diff := _base_difference(saved["tensors"], base_fingerprint(base)):
            why[0] = (f"{path}: its LoRA adapters were trained on the base {saved['hf_checkpoint']}, and the base "
                      f"loaded now, --hf-checkpoint {base}, differs: {diff}. Resume on the run's own base")
    dist.broadcast_object_list(why, src=0)
    if why[0]:
        raise ConfigError(why[0])


@cpu_compat.in_megatron_scope
def save_lora_adapters(root: str | os.PathLike, policy, config: dict) -> Path:
    """Collective. A LoRA policy's adapters as a checkpoint of step 0 with no training state (`root/iter_0000000`,
    `root/latest`): the adapters at any TP/PP layout, `lora_base.json` and `config` as `config.json`. What
    `megarl-convert-checkpoint --from-peft` writes and `--lora-checkpoint` starts a run from (`load_weights`)."""
    from megatron.core import dist_checkpointing

    if policy.lora is None:
        raise ValueError("save_lora_adapters needs a policy built with LoRA adapters")
    final = Path(root) / iter_name(0)
    if dist.get_rank() == 0:
        final.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": _model_sharded_state_dict(policy)}, str(final))
    if dist.get_rank() == 0:
        write_lora_base(final, policy)
        (final / SAVED_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        (Path(root) / LATEST).write_text(final.name + "\n")
    dist.barrier()
    return final


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
