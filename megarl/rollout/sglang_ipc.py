"""One CUDA-IPC payload per SGLang TP rank, each made on that rank's own GPU (colocated SGLang at TP > 1).

SGLang 0.5.23 hands a `load_format="flattened_bucket"` update to its TP workers as a list, and worker r opens
only entry r (`tp_worker.deserialize_own_rank`) and loads the whole bucket of full Hugging Face tensors from it
(`model.load_weights` takes its own TP shard): torch's CUDA-IPC refcounting is per payload, so one payload opened
by several processes is released early or never, and a handle to the leader's GPU opened by every TP rank puts a
CUDA context of each of them on the leader's GPU. slime and verl gather one handle per GPU; so does this module.

The layout: the engine of a model replica runs on its leader's GPU and the next `tp_size - 1` (`launch`'s
`base_gpu_id`), which are the GPUs of the trainer ranks `leader .. leader + tp_size - 1`: the first stage's TP
ranks of the leader's replica (TP is megatron's innermost dimension), checked by `build_ipc_gather`. Those ranks
form an `IpcGather`.

Lock-step with the streamed export, as in slime: after `gather_tp`'s all-gather every TP rank holds each full
tensor, so every rank of the gather reads the same stream (`MegatronPolicy.iter_hf(every_tp_rank=True)`) and
packs the same buckets (`pack_buckets` with the same size and dtype) on its own GPU; only the payloads move. Per
bucket, every rank of the gather takes part in two gloo collectives:

1. `gather`: each rank serialises its own bucket and the leader gathers the payloads in rank order, which is the
   engine's TP order (the leader: `payloads`, called by `SGLangEngine.load_weight_buckets`; the others: `serve`);
2. `outcome`: once the engine has loaded the bucket (SGLang returns from `update_weights_from_tensor` after
   loading), the leader broadcasts whether it did (`loaded`, or `close` with the error); each other rank then
   drops its copy and calls `torch.cuda.ipc_collect()`, as slime does per chunk, so the memory the engine mapped
   is given back.

After the last bucket the leader broadcasts the end of the sync (`close`). A leader that fails anywhere (before
the first bucket, between buckets, in the engine) goes on to the next point where the others wait, packs and
gathers the bucket they are at if need be, and tells them its error there; they raise it (`WeightSyncError`
naming the leader) and every rank drains the rest of the export, whose collectives need them all. A collective
that fails or times out (`--distributed-timeout-seconds`) raises an error naming this rank, the leader, the
bucket and what it waited for.

What it costs: on each of the engine's GPUs, the buckets a rank packs itself (`--sync-bucket-mb`), and with
PP > 1 the later stages' tensors sent to every TP rank of the first stage instead of TP rank 0 only.
"""

from __future__ import annotations

import datetime
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megarl.rollout.weight_sync import WeightBucket, WeightSyncError


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
    the replica's leader, holds the engine. `group` is a gloo group of `ranks` (see the module docstring for the
    protocol: the leader runs `payloads` and `loaded` per bucket and `close` at the end, every other rank `serve`
    over its own buckets)."""

    def __init__(self, group, ranks: Sequence[int], *, serialize: Callable[[WeightBucket], str] | None = None):
        self.group = group
        self.ranks = list(ranks)
        self.src = self.ranks[0]
        self._serialize = serialize
        self._bucket = 0  # buckets gathered in this sync
        self._pending = False  # the leader gathered a bucket whose outcome it has not told

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.src

    def serialize(self, bucket: WeightBucket) -> str:
        return (self._serialize or serialize_bucket)(bucket)

    # -- the two collectives, their failures named ----------------------------------------------------------

    def _collective(self, what: str, fn, *args):
        try:
            return fn(*args, group=self.group)
        except RuntimeError as e:  # gloo's timeout, or a peer that went away: say who waited for what
            role = ("the leader" if self.is_leader else f"on the GPU of TP rank {self.ranks.index(dist.get_rank())}")
            raise WeightSyncError(
                f"rank {dist.get_rank()} ({role} of the colocated SGLang engine on ranks {self.ranks}): {what} "
                f"failed: {type(e).__name__}: {e}. Every rank of the engine packs the same buckets from the "
                "streamed export; look for an earlier error on the other ranks, or raise "
                "--distributed-timeout-seconds if the engine loads a bucket slowly") from e

    def _gather(self, bucket: WeightBucket | None) -> list | None:
        """Collective: this rank's (rank, GPU, payload) to the leader; the leader gets them in rank order."""
        mine = None if bucket is None else (dist.get_rank(), _device_index(bucket.flat), self.serialize(bucket))
        out = [None] * self.tp_size if self.is_leader else None
        what = (f"gathering the payloads of ranks {self.ranks[1:]} for bucket {self._bucket}" if self.is_leader
                else f"sending the payload of bucket {self._bucket} to leader {self.src}")
        self._collective(what, dist.gather_object, mine, out, self.src)
        self._bucket += 1
        return out

    def _tell(self, message=None, end: bool = False):
        """Collective: the leader's `message` (("ok",), ("error", text), ("end", text or None)) on every rank;
        `end`: the message ends the sync rather than a bucket (for the error's words)."""
        box = [message]
        subject = "the end of the sync" if end else f"bucket {self._bucket - 1}"
        what = (f"telling ranks {self.ranks[1:]} the outcome of {subject}" if self.is_leader
                else f"waiting for leader {self.src} to load {subject} into the engine" if not end
                else f"waiting for leader {self.src} to end the sync")
        self._collective(what, dist.broadcast_object_list, box, self.src)
        return box[0]

    # -- the leader ---------------------------------------------------------------------------------------

    def payloads(self, bucket: WeightBucket, tp_size: int | None = None) -> list[str]:
        """Leader: one payload per engine TP rank (`tp_size` of them), in TP order, each serialised by the rank
        on that GPU from its own copy of `bucket`. The caller loads them, then calls `loaded`."""
        if tp_size not in (None, self.tp_size):
            raise WeightSyncError(f"an engine at TP {tp_size} served by {self.tp_size} ranks ({self.ranks})")
        if self._pending:
            raise WeightSyncError("IpcGather.payloads: the previous bucket's outcome was not told (call loaded)")
        gathered = self._gather(bucket)
        self._pending = True
        problem = _check_gathered(gathered, self.ranks)
        if problem is not None:
            raise WeightSyncError(problem)
        return [g[2] for g in gathered]

    def loaded(self) -> None:
        """Leader: the engine has loaded the bucket of the last `payloads`; the other ranks drop their copies."""
        self._pending = False
        self._tell(("ok",))

    def close(self, error: str | None = None, rest: Iterable[WeightBucket] = ()) -> None:
        """Leader, at the end of the sync, also when it failed (`error`). A sync that failed tells the others
        where they wait: at the bucket just gathered, else at the next bucket of `rest` (the buckets this rank
        did not load, which it packs so that it meets them there), else at the end."""
        try:
            if error is None:
                self._tell(("end", None), end=True)
                return
            if not self._pending and next(iter(rest), None) is not None:
                self._gather(None)  # the others' payloads of the bucket they are at, unused
                self._pending = True
            self._tell(("error", error) if self._pending else ("end", error), end=not self._pending)
        finally:
            self._pending, self._bucket = False, 0

    # -- the other ranks ----------------------------------------------------------------------------------

    def serve(self, buckets: Iterable[WeightBucket]) -> int:
        """Every rank but the leader, during the leader's sync: for each of this rank's `buckets` (packed from
        its own export stream, as the leader packs its own), send the leader its payload and keep the bucket until
        the engine has loaded it. Returns the buckets served; raises `WeightSyncError` with the leader's message
        when its sync failed (the caller then drains its export)."""
        served = 0
        try:
            for bucket in buckets:
                self._gather(bucket)
                message = self._tell()
                del bucket  # the engine has loaded it (or given up): its IPC memory can go
                release_ipc()
                if message[0] != "ok":
                    raise WeightSyncError(f"the weight sync on rank {self.src} failed: {message[1]}")
                served += 1
            message = self._tell(end=True)
            if message[0] != "end" or message[1] is not None:
                raise WeightSyncError(f"the weight sync on rank {self.src} failed: {message[1]} (this rank "
                                      f"packed {served} buckets)")
            return served
        finally:
            self._bucket = 0


def _check_gathered(gathered: list, ranks: list[int]) -> str | None:
    """Why the leader cannot hand `gathered` to the engine, or None: a payload from the wrong rank, or copies on
    GPUs that are not the engine's TP ranks' GPUs."""
    got = [g[0] for g in gathered]
    if got != ranks:
        return f"IPC payloads came from ranks {got}, expected {ranks} (engine TP order)"
    devices = [g[1] for g in gathered]
    if devices[0] >= 0 and devices != list(range(devices[0], devices[0] + len(ranks))):
        return (f"ranks {ranks} hold their buckets on GPUs {devices}, but the engine's TP ranks run on GPUs "
                f"{devices[0]}..{devices[0] + len(ranks) - 1} (launch's base_gpu_id onward): each rank must be on "
                "the GPU of the TP rank it serves (one node, local rank = GPU index)")
    return None


def build_ipc_gather(tp_size: int, is_leader: bool, timeout_s: float = 600.0,
                     place: tuple[int, int, int] | None = None) -> IpcGather | None:
    """Collective on every rank of the job: the `IpcGather` of this rank's colocated engine (ranks `leader ..
    leader + tp_size - 1` for each model-parallel leader that launches one), None where this rank serves no
    engine or `tp_size` is 1 (the leader's own payload is then the only one). `place`: this rank's (TP rank,
    PP rank, CP rank); every rank of a gather must be TP rank i of its leader's first stage, which reads the same
    export stream (checked when given, on every rank alike)."""
    if tp_size < 1:
        raise ValueError(f"--sglang-tp-size must be >= 1, got {tp_size}")
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (bool(is_leader), place))
    if tp_size == 1:
        return None
    leaders = [r for r, (f, _) in enumerate(flags) if f]
    spans = [list(range(leader, leader + tp_size)) for leader in leaders]
    for a, b in zip(spans, spans[1:]):
        if b[0] <= a[-1]:
            raise ValueError(f"--sglang-tp-size {tp_size}: the engines of leaders {a[0]} and {b[0]} would share "
                             f"ranks {sorted(set(a) & set(b))}; colocated engines need one GPU per TP rank each")
    if spans and spans[-1][-1] >= dist.get_world_size():
        raise ValueError(f"--sglang-tp-size {tp_size}: leader {spans[-1][0]}'s engine needs ranks up to "
                         f"{spans[-1][-1]}, but the job has {dist.get_world_size()} ranks")
    for ranks in spans:
        for i, r in enumerate(ranks):
            if flags[r][1] is not None and flags[r][1] != (i, 0, 0):
                raise ValueError(
                    f"--sglang-tp-size {tp_size}: rank {r}, on the GPU of TP rank {i} of leader {ranks[0]}'s "
                    f"engine, is (TP, PP, CP) rank {flags[r][1]}, not ({i}, 0, 0): a colocated engine's GPUs must "
                    "be those of its leader's first-stage TP ranks, so at most --tensor-model-parallel-size")
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = None
    for ranks in spans:  # every rank creates every group, in the same order
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if dist.get_rank() in ranks:
            mine = IpcGather(group, ranks)
    return mine
