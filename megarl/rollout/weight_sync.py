"""Weight sync, actor -> rollout engine: size-bounded flat buckets, one version per sync, and a check.

The actor's export gathers its TP/PP shards into full Hugging Face-named tensors on each model-parallel leader
(`megarl.mcore.convert.export_hf_weights`). This module packs them into buckets and hands the buckets to the
engine:

- A bucket is one flat byte tensor plus, per tensor, its name, shape, dtype and byte range: the layout of SGLang's
  `FlattenedTensorBucket`, so the SGLang adapter passes a bucket on as `load_format="flattened_bucket"` (in
  colocated mode as CUDA IPC handles: the bytes never leave the GPU). Buckets are bounded by `bucket_bytes`, so a
  sync needs one bucket of extra memory, not a second copy of the model, on the engine's side.
- A bucket holds one dtype. Every tensor then starts at an offset aligned for its dtype with no padding, and the
  bytes handed over are exactly the parameter bytes; `push` refuses a name sent twice, so a sync moves each
  parameter once (`SyncStats.bytes == model_parameter_count(shape) * itemsize`, checked by the tests). Floating
  tensors travel in the engine's dtype (a bf16 engine gets Megatron's fp32 norm weights as bf16): the engine
  would round them on load anyway.
- Every sync carries a weight version, which the engine stamps on the completions it generates afterwards.

Every `RolloutEngine` takes buckets (`load_weight_buckets`): SGLang passes them on as they are, the built-in engine
copies each bucket's tensors (views into the bucket, no copy on the way) into its own weights. An engine that
generates with the actor's own parameters (`shares_actor_weights`) gets no buckets, only a version (`stamp`).
A LoRA actor's engine gets merged weights, or (`--lora-weight-sync adapter`, an `AdapterTaker`: SGLang) the base
weights once in buckets and then, at every sync, only the adapters in PEFT form (`push_adapter`), which it loads
under a name of their version (`adapter_name`) and applies to every request after.
Nothing here knows Megatron.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol

import torch

from megarl.model_shape import ModelShape

DEFAULT_BUCKET_BYTES = 512 << 20


class WeightSyncError(RuntimeError):
    """A sync that did not deliver the actor's weights (duplicate names, wrong version, log-prob mismatch)."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a bucket: bytes [start, end) of the flat tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class WeightBucket:
    """Tensors of one dtype and device, flattened into one uint8 tensor."""

    flat: torch.Tensor  # uint8 [nbytes]
    slots: list[TensorSlot]

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) pairs: views into `flat`, no copy."""
        return [(s.name, self.flat[s.start : s.end].view(s.dtype).view(s.shape)) for s in self.slots]


class BucketTaker(Protocol):
    """What a weight sync needs of an engine (`megarl.rollout.base.RolloutEngine` has it all)."""

    dtype: torch.dtype | None
    weight_version: int
    shares_actor_weights: bool

    def load_weight_buckets(self, buckets: Iterable[WeightBucket], version: int) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None: ...


class AdapterTaker(Protocol):
    """An engine that applies LoRA adapters itself (`--lora-weight-sync adapter`): it holds the base weights and
    takes each version's adapters whole, PEFT-named (`base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight`),
    with their `adapter_config.json` dict, in place of the previous version's."""

    weight_version: int

    def load_lora_adapter(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None: ...


def adapter_name(version: int) -> str:
    """The name the adapters of weight version `version` are loaded under, and which every request then names:
    one per version, so a request can never be served by an adapter other than the one it names."""
    return f"megarl-v{version}"


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own), one per
    dtype and device; a bucket is built when it is full, so at most one per dtype is pending at a time. Floating
    tensors are cast to `dtype` when given (the engine's dtype: what it stores is what moves)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    pending: dict[tuple, tuple[list[tuple[str, torch.Tensor]], int]] = {}
    for name, tensor in named_tensors:
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * target.itemsize
        key = (target, tensor.device)
        group, size = pending.get(key, ([], 0))
        if group and size + nbytes > bucket_bytes:
            yield _flatten(group, target)
            group, size = [], 0
        pending[key] = (group + [(name, tensor)], size + nbytes)
    for (target, _), (group, _) in pending.items():
        yield _flatten(group, target)


@torch.no_grad()
def _flatten(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> WeightBucket:
    total = sum(t.numel() for _, t in named) * dtype.itemsize
    flat = torch.empty(total, dtype=torch.uint8, device=named[0][1].device)
    slots, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * dtype.itemsize
        if nbytes:
            flat[offset : offset + nbytes].view(dtype).copy_(tensor.detach().reshape(-1))  # copy_ casts
        slots.append(TensorSlot(name, tuple(tensor.shape), dtype, offset, offset + nbytes))
        offset += nbytes
    return WeightBucket(flat, slots)


@dataclass
class SyncStats:
    """What one sync moved, and how long it took (on the model-parallel leader that ran the engine)."""

    version: int
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    peak_gpu_bytes: int = 0  # CUDA peak allocated during the sync; 0 on CPU
    names: list[str] = field(default_factory=list, repr=False)

    def plus(self, other: SyncStats) -> SyncStats:
        """Two parts of one sync as one (the base weights, then the adapters)."""
        return SyncStats(self.version, self.tensors + other.tensors, self.buckets + other.buckets,
                         self.bytes + other.bytes, self.seconds + other.seconds,
                         max(self.peak_gpu_bytes, other.peak_gpu_bytes), self.names + other.names)

    def metrics(self) -> dict[str, float]:
        return {"weight_version": self.version, "sync_bytes": self.bytes, "sync_buckets": self.buckets,
                "sync_seconds": self.seconds, "sync_gb_per_s": self.bytes / max(self.seconds, 1e-9) / 1e9,
                "sync_peak_gpu_mib": self.peak_gpu_bytes / 2**20}


def push(engine: BucketTaker, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncStats:
    """Hand `named_tensors` to `engine` in buckets, cast to the engine's `dtype` (when not None), and stamp
    `version`; returns what moved."""
    stats = SyncStats(version=version)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine.load_weight_buckets(_counted(pack_buckets(named_tensors, bucket_bytes, engine.dtype), stats), version)
    if engine.weight_version != version:
        raise WeightSyncError(f"after the sync the engine reports weight version {engine.weight_version}, "
                              f"expected {version}")
    if cuda:
        torch.cuda.synchronize()
        stats.peak_gpu_bytes = torch.cuda.max_memory_allocated()
    stats.seconds = time.perf_counter() - start
    return stats


def push_adapter(engine: AdapterTaker, tensors: dict[str, torch.Tensor], config: dict, version: int) -> SyncStats:
    """Hand the LoRA adapters of `version` (whole, PEFT-named, `config` their adapter_config.json) to an engine that
    applies them itself and already holds the base weights; returns what moved (the adapters, in their dtype)."""
    stats = SyncStats(version=version, tensors=len(tensors), names=sorted(tensors),
                      bytes=sum(t.numel() * t.element_size() for t in tensors.values()))
    start = time.perf_counter()
    engine.load_lora_adapter(tensors, config, version)
    if engine.weight_version != version:
        raise WeightSyncError(f"after the adapter sync the engine reports weight version {engine.weight_version}, "
                              f"expected {version}")
    stats.seconds = time.perf_counter() - start
    return stats


def stamp(engine: BucketTaker, version: int) -> SyncStats:
    """The sync of an engine that generates with the actor's own parameters (`shares_actor_weights`, e.g.
    Megatron's dynamic engine): nothing moves, the engine only takes the new version."""
    if not engine.shares_actor_weights:
        raise WeightSyncError(f"{type(engine).__name__} holds weights of its own: push them (weight_sync.push)")
    start = time.perf_counter()
    engine.update_weights((), version=version)
    return SyncStats(version=version, seconds=time.perf_counter() - start)


def _counted(buckets: Iterator[WeightBucket], stats: SyncStats) -> Iterator[WeightBucket]:
    seen: set[str] = set()
    for bucket in buckets:
        for slot in bucket.slots:
            if slot.name in seen:
                raise WeightSyncError(f"{slot.name!r} was sent twice in one sync: each parameter moves once")
            seen.add(slot.name)
            stats.names.append(slot.name)
        stats.tensors += len(bucket.slots)
        stats.buckets += 1
        stats.bytes += bucket.nbytes
        yield bucket


def model_parameter_count(shape: ModelShape) -> int:
    """Parameters of the Hugging Face model `shape` describes, tied embeddings counted once, every expert
    included: the number of elements one full sync must move."""
    return shape.param_count()


# -- verification ------------------------------------------------------------------------------------------------


def probe_sequence(vocab_size: int, length: int = 32, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence on which actor and engine log-probs are compared after a sync."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def check_probe(actor_logp: torch.Tensor, engine_logp: torch.Tensor, tolerance: float) -> dict[str, float]:
    """Compare the actor's and the engine's log-probs of the probe's tokens; raise when the mean absolute
    difference exceeds `tolerance` (the engine then holds other weights than the actor: a broken sync)."""
    actor_logp, engine_logp = actor_logp.float().flatten().cpu(), engine_logp.float().flatten().cpu()
    if actor_logp.shape != engine_logp.shape:
        raise WeightSyncError(f"probe: actor gave {actor_logp.numel()} log-probs, engine {engine_logp.numel()}")
    diff = (actor_logp - engine_logp).abs()
    out = {"sync_probe_absdiff_mean": float(diff.mean()), "sync_probe_absdiff_max": float(diff.max())}
    if not out["sync_probe_absdiff_mean"] <= tolerance:  # also catches NaN
        raise WeightSyncError(
            f"weight sync check failed: the engine's log-probs on the probe sequence differ from the actor's by "
            f"{out['sync_probe_absdiff_mean']:.3g} on average (max {out['sync_probe_absdiff_max']:.3g}), more than "
            f"--verify-sync-tolerance {tolerance:g}")
    return out
