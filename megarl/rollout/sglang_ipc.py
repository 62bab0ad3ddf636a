"""One CUDA-IPC payload per SGLang TP rank, each made on that rank's own GPU (colocated SGLang at TP > 1).

SGLang 0.5.23 hands a `load_format="flattened_bucket"` update to its TP workers as a list, and worker r opens
only entry r (`tp_worker.deserialize_own_rank`): torch's CUDA-IPC refcounting is per payload, so one payload
opened by several processes is released early or never, and a handle to the leader's GPU opened by every TP
rank puts a CUDA context of each of them on the leader's GPU. slime and verl gather one handle per GPU; so does
this module.

The layout: the engine of a model replica runs on its leader's GPU and the next `tp_size - 1` (`launch`'s
`base_gpu_id`), which are the GPUs of the trainer ranks `leader .. leader + tp_size - 1`. Those ranks form an
`IpcGather`. Per bucket the leader broadcasts the bucket's layout (gloo) and bytes (the tensor group: NCCL on
GPUs), every rank keeps its own copy on its own GPU and serialises it, and the leader gathers the payloads in
rank order, which is the engine's TP order. Each rank keeps its copy alive until the engine has loaded the bucket
(SGLang returns from `update_weights_from_tensor` after loading), then drops it and calls
`torch.cuda.ipc_collect()`, as slime does per chunk, so the memory the engine mapped is given back.

What it costs: one bucket of memory on each of the engine's GPUs (`--sync-bucket-mb`) and one bucket broadcast
within a node. The leader runs `payloads` per bucket and `close` at the end of the sync (also when it failed: the
others then raise with its message); every other rank of the group runs `follow` for the same sync.

What it needs of the export: the other ranks sit in `follow` while the leader pushes, so the leader's buckets must
not be filled by an export that runs collectives with them (the streamed `iter_hf`, whose TP gathers every rank
joins): the export is finished before the push (`export_hf`). For a streamed export the bytes should come from the
export itself instead, as in slime: after `gather_tp`'s all-gather every TP rank of stage 0 holds each full tensor,
so each rank can pack the same buckets from its own stream and only the payloads need gathering.
"""

from __future__ import annotations

import datetime
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megarl.rollout.weight_sync import TensorSlot, WeightBucket, WeightSyncError


def serialize_bucket(bucket: WeightBucket) -> str:
    """This process's `MultiprocessingSerializer` payload of `bucket` in the form `load_format="flattened_bucket"`
    expects, for the one SGLang TP rank on the bucket's GPU (`IpcGather` collects one per TP rank). For a CUDA
    bucket the payload holds an IPC handle: the bucket must stay alive until the engine has loaded it
    (`update_weights_from_tensor` returns after loading)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if bucket.flat.is_cuda:  # SGLang's fix for CUDA IPC between processes that number the GPUs differently
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    metadata = [FlattenedTensorMetadata(name=s.name, shape=torch.Size(s.shape), dtype=s.dtype, start_idx=s.start,
                                        end_idx=s.end, numel=s.end - s.start) for s in bucket.slots]
    return MultiprocessingSerializer.serialize({"flattened_tensor": bucket.flat, "metadata": metadata},
                                               output_str=True)


def release_ipc() -> None:
    """Give back CUDA-IPC memory whose consumers have closed their handles (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.is_cuda else -1


class IpcGather:
    """The trainer ranks on one colocated engine's GPUs; `ranks[i]` is on engine TP rank i's GPU and `ranks[0]`,
    the replica's leader, holds the engine. `group` is a gloo group of `ranks` (objects); `tensor_group` carries
    the bucket bytes (the default backend's group of the same ranks; `group` when None)."""

    def __init__(self, group, ranks: Sequence[int], *, tensor_group=None,
                 serialize: Callable[[WeightBucket], str] | None = None):
        self.group = group
        self.tensor_group = tensor_group if tensor_group is not None else group
        self.ranks = list(ranks)
        self.src = self.ranks[0]
        self._serialize = serialize
        self._held: WeightBucket | None = None  # this rank's copy of the bucket being loaded

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def serialize(self, bucket: WeightBucket) -> str:
        return (self._serialize or serialize_bucket)(bucket)

    def _release(self) -> None:
        """(The other ranks) the engine has loaded the previous bucket: drop this rank's copy, give its IPC memory
        back."""
        if self._held is not None:
            self._held = None
            release_ipc()

    def _announce(self, message) -> None:
        box = [message]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def _gather(self, bucket: WeightBucket) -> list | None:
        mine = (dist.get_rank(), _device_index(bucket.flat), self.serialize(bucket))
        out = [None] * self.tp_size if dist.get_rank() == self.src else None
        dist.gather_object(mine, out, dst=self.src, group=self.group)
        return out

    def payloads(self, bucket: WeightBucket, tp_size: int | None = None) -> list[str]:
        """Leader: one payload per engine TP rank (`tp_size` of them), in TP order, each serialised by the rank on
        that GPU. The
        leader's own copy is the caller's bucket, and the caller collects its IPC memory once the engine has
        loaded it (`SGLangEngine.load_weight_buckets`)."""
        if tp_size not in (None, self.tp_size):
            raise WeightSyncError(f"an engine at TP {tp_size} served by {self.tp_size} ranks ({self.ranks})")
        self._announce(("bucket", bucket.flat.numel(), bucket.flat.device.type,
                        [(s.name, s.shape, s.dtype, s.start, s.end) for s in bucket.slots]))
        dist.broadcast(bucket.flat, src=self.src, group=self.tensor_group)
        gathered = self._gather(bucket)
        ranks = [g[0] for g in gathered]
        if ranks != self.ranks:
            raise WeightSyncError(f"IPC payloads came from ranks {ranks}, expected {self.ranks} (engine TP order)")
        devices = [g[1] for g in gathered]
        if devices[0] >= 0 and devices != list(range(devices[0], devices[0] + self.tp_size)):
            raise WeightSyncError(
                f"ranks {self.ranks} hold their bucket copies on GPUs {devices}, but the engine's TP ranks run on "
                f"GPUs {devices[0]}..{devices[0] + self.tp_size - 1} (launch's base_gpu_id onward): each rank must "
                "be on the GPU of the TP rank it serves (one node, local rank = GPU index)")
        return [g[2] for g in gathered]

    def close(self, error: str | None = None) -> None:
        """Leader: the sync is over (`error`: it failed, with this message); the other ranks leave `follow`."""
        self._announce(("end", error))

    def follow(self) -> int:
        """Every rank but the leader, during the leader's sync: copy each bucket onto this rank's GPU, serialise
        it and send the payload to the leader, until the leader closes the sync. Returns the buckets served;
        raises `WeightSyncError` with the leader's message when its sync failed."""
        served = 0
        while True:
            message = self._announce(None)
            self._release()
            if message[0] == "end":
                if message[1] is not None:
                    raise WeightSyncError(f"the weight sync on rank {self.src} failed: {message[1]}")
                return served
            _, nbytes, device_type, slots = message
            device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu"
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=self.src, group=self.tensor_group)
            self._held = WeightBucket(flat, [TensorSlot(*s) for s in slots])  # alive until the engine loaded it
            self._gather(self._held)
            served += 1


def build_ipc_gather(tp_size: int, is_leader: bool, timeout_s: float = 600.0) -> IpcGather | None:
    """Collective on every rank of the job: the `IpcGather` of this rank's colocated engine (ranks `leader ..
    leader + tp_size - 1` for each model-parallel leader that launches one), None where this rank serves no
    engine or `tp_size` is 1 (the leader's own payload is then the only one)."""
    if tp_size < 1:
        raise ValueError(f"--sglang-tp-size must be >= 1, got {tp_size}")
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(is_leader))
    if tp_size == 1:
        return None
    leaders = [r for r, f in enumerate(flags) if f]
    spans = [list(range(leader, leader + tp_size)) for leader in leaders]
    for a, b in zip(spans, spans[1:]):
        if b[0] <= a[-1]:
            raise ValueError(f"--sglang-tp-size {tp_size}: the engines of leaders {a[0]} and {b[0]} would share "
                             f"ranks {sorted(set(a) & set(b))}; colocated engines need one GPU per TP rank each")
    if spans and spans[-1][-1] >= dist.get_world_size():
        raise ValueError(f"--sglang-tp-size {tp_size}: leader {spans[-1][0]}'s engine needs ranks up to "
                         f"{spans[-1][-1]}, but the job has {dist.get_world_size()} ranks")
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = None
    for ranks in spans:  # every rank creates every group, in the same order
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        tensors = dist.new_group(ranks, timeout=timeout) if dist.get_backend() != "gloo" else group
        if dist.get_rank() in ranks:
            mine = IpcGather(group, ranks, tensor_group=tensors)
    return mine
