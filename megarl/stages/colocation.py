"""Who holds the accelerator, and the weight sync: one step is enter_rollout -> generate -> enter_training -> train
-> free_for_push -> sync.

With `--offload-optimizer` / `--offload-params` the actor moves its state off the GPU while the engine generates;
the engine releases its KV cache (and weights) while the actor trains. After every update the actor's weights go
to the engine as HF-named tensors in buckets (`megarl.rollout.weight_sync`), or, for an engine that generates with
the actor's own parameters, only a new version. The engine takes its weights' memory back for the push (SGLang
resumes it first), so before the push the actor lets go of what the push does not read: its gradients, and with
--offload-optimizer its optimizer state (`free_for_push`). On CPU every one of these is a no-op but the sync (and
the gradients' storage, freed and given back zeroed, which the next step does anyway).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.config import RolloutConfig, TrainingConfig
from megarl.mcore import parallel
from megarl.mcore.actor import MegatronPolicy
from megarl.mcore.parallel import ParallelInfo
from megarl.rollout import RolloutEngine, weight_sync
from megarl.rollout.base import as_engine
from megarl.samples import PackedSamples
from megarl.stages import mismatch


def enter_rollout(actor: MegatronPolicy, engine: RolloutEngine | None, t: TrainingConfig,
                  sync: WeightSync | None = None) -> dict[str, float]:
    """Hand the GPU to the engine: offload the actor (per --offload-optimizer / --offload-params), then the engine
    re-acquires its KV cache and flushes prefixes cached under the old weights. With `sync` holding the probe of
    its last sync (--verify-weight-sync), the engine then scores it, so its KV cache never comes back beside the
    optimizer state. Returns that check's metrics ({} without one, and off the replica's leader)."""
    if t.offload_optimizer or t.offload_params:
        actor.offload(params=t.offload_params, optimizer=t.offload_optimizer)
    if engine is not None:
        engine.resume_memory()
    return sync.check_probe() if sync is not None else {}


def enter_training(actor: MegatronPolicy, engine: RolloutEngine | None, keep_weights: bool = False) -> None:
    """Hand the GPU to the actor: the engine releases its KV cache and weights, the actor takes back what it
    offloaded. `keep_weights` where no sync follows before the next rollout (an evaluation between steps): the
    engine keeps its weights, which a release would lose (`SGLangEngine.release_memory`)."""
    if engine is not None:
        if keep_weights and "keep_weights" in inspect.signature(engine.release_memory).parameters:
            engine.release_memory(keep_weights=True)
        else:  # a plugin engine written before `keep_weights` keeps its one-argument release_memory
            engine.release_memory()
    actor.onload()


def free_for_push(actor: MegatronPolicy, t: TrainingConfig) -> None:
    """Before a push to a colocated engine, on every rank of the replica: the engine's weights come back (SGLang
    resumes them before the first bucket, `SGLangEngine.load_weight_buckets`) while the actor still holds its
    training state. The push reads only the actor's weights, so its fp32 gradients go now (the next step zeroes
    them anyway) and, with --offload-optimizer, its optimizer state moves to the host now rather than at
    `enter_rollout`: the push then holds the actor's weights, the engine's and a few buckets, not 4 + 12 bytes a
    parameter besides (the planner's "weight sync" phase). `enter_training` brings everything back before the next
    update; a checkpoint saved between the two brings it back first (`megarl.trainer.checkpoints.save`)."""
    actor.offload(params=False, optimizer=t.offload_optimizer)


@dataclass(frozen=True)
class Probe:
    """The actor's log-probs on a probe sequence, kept on the replica's leader until the engine scores it."""

    version: int
    tokens: list[int]
    actor_logp: torch.Tensor  # [len(tokens) - 1], on the CPU


class WeightSync:
    """The actor -> engine sync of a model replica; every rank of the replica calls it (the export is collective).

    Whether weights move at all is the engine's to say (`shares_actor_weights`); the replica's leader holds the
    engine and tells the other ranks once. The export is streamed (`MegatronPolicy.iter_hf`): the leader receives
    one full tensor at a time and packs it into the current bucket, so a sync costs it a few buckets
    (`--sync-bucket-mb`) of extra memory, not a copy of the model (3 to 4 measured on CPU: the tensors of the
    bucket being filled, the bucket, the one the engine is loading; tests/unit/test_colocation.py).

    A colocated engine at TP > 1 (SGLang's `ipc_tp_size`) loads every bucket on each of its TP ranks from that
    rank's GPU, which is a trainer rank's: the first stage's TP ranks of the replica. Each of them reads the export
    in full (`iter_hf(every_tp_rank=True)`), packs the same buckets as the leader and hands the leader its own
    payload per bucket (`megarl.rollout.sglang_ipc`); at TP 1 nothing changes.

    --verify-weight-sync is split in two: the actor's log-probs on the probe are computed at the sync, while the
    actor holds the GPU (the forward is collective); the engine scores the probe at the next `enter_rollout`,
    after the actor's optimizer (and weights) have left the GPU and the engine has taken back its KV cache. The
    check so runs before the engine generates anything with the synced weights, never with the optimizer state
    and the KV cache on the GPU at once.

    --lora-weight-sync adapter (SGLang): the first sync sends the frozen base weights in buckets (not merged: the
    adapters may be trained already, on a resumed run), then every sync the adapters alone, gathered whole and in
    PEFT form on every rank (`MegatronPolicy.peft_adapters`) and loaded by the leader's engine as the version's
    adapter (`weight_sync.push_adapter`); the probe is then scored by the engine with that adapter applied."""

    def __init__(self, actor: MegatronPolicy, engine: RolloutEngine | None, r: RolloutConfig, info: ParallelInfo,
                 timeout_s: float = 600.0, training: TrainingConfig | None = None):
        """`timeout_s`: how long a rank on a colocated engine's GPUs waits for the leader per bucket
        (--distributed-timeout-seconds). `training`: the run's settings; given (the trainer gives them), every
        push to a colocated engine is preceded by `free_for_push`; without them the actor keeps its state through
        the push."""
        self.actor, self.engine, self.r, self.info, self.training = actor, engine, r, info, training
        # The engine shares the GPUs and takes its weights' memory back for the push: not servers elsewhere, not
        # the engine of --async-staleness (beside the actor, never in its memory)
        self.colocated = training is not None and not r.rollout_servers and not training.async_staleness
        mine = None
        if engine is not None:  # what the other ranks of the replica need to know of the leader's engine
            mine = (engine.shares_actor_weights, as_engine(engine).ipc_tp_size, engine.dtype)
        self.shares_actor_weights, self.ipc_tp, self.dtype = (
            parallel.broadcast_in_mp_group(mine) if info.replica_size > 1 else mine or (None, 1, None))
        self.pending: Probe | None = None  # the last sync's probe, not yet scored by the engine
        self.ipc = None  # this rank's share of a colocated engine's IPC gather (`ipc_tp` > 1)
        if self.ipc_tp > 1 and not self.shares_actor_weights:
            from megarl.rollout.sglang_ipc import build_ipc_gather

            self.ipc = build_ipc_gather(self.ipc_tp, info.is_mp_leader, timeout_s,
                                        place=(info.tp_rank, info.pp_rank, info.cp_rank))
            if engine is not None:
                engine.use_ipc(self.ipc)
        self.pending_mismatch: mismatch.ActorSide | None = None  # --mismatch-check-interval's actor side
        self.adapters = r.lora_weight_sync == "adapter" and not self.shares_actor_weights
        self.base_sent = False  # --lora-weight-sync adapter: the engine holds the base weights

    def __call__(self, version: int, rows: PackedSamples | None = None) -> dict[str, float]:
        """Sync the actor's weights as `version` (with --verify-weight-sync: and take the actor's side of the
        probe; with --mismatch-check-interval N, every N versions, the actor's distributions on a few of `rows`,
        the step's batch). Returns the sync's metrics on the leader ({} elsewhere)."""
        if self.colocated and not self.shares_actor_weights:
            free_for_push(self.actor, self.training)
        if self.shares_actor_weights:
            metrics = weight_sync.stamp(self.engine, version).metrics() if self.engine is not None else {}
        elif self.adapters:
            metrics = self._push_adapters(version)
        else:
            stats = self._push(version)
            metrics = stats.metrics() if stats is not None else {}
        if self.r.verify_weight_sync:
            self.pending = actor_probe(self.actor, version, gather=self.info.replica_size > 1)
        if rows is not None and (n := self.r.mismatch_check_interval) and version % n == 0:
            self.pending_mismatch = mismatch.actor_side(self.actor, rows, self.r.mismatch_check_rows,
                                                        gather=self.info.replica_size > 1)
        return metrics

    def _push(self, version: int, merge_adapters: bool = True) -> weight_sync.SyncStats | None:
        """The whole model in buckets; what moved on the leader (None elsewhere). `merge_adapters` False: the frozen
        base weights, for an engine that applies the adapters itself."""
        # gathers TP/PP shards on the leader (for an engine at TP > 1 on the first stage's TP ranks too), one
        # tensor at a time; collective
        # every TP rank alike, on every stage: the later stages' TP rank r sends to the first stage's over their
        # own PP group
        kw = {"every_tp_rank": True} if self.ipc_tp > 1 else {}
        named = self.actor.iter_hf(**kw) if merge_adapters else self.actor.iter_hf(**kw, merge_adapters=False)
        try:
            if self.engine is None:
                if self.ipc is not None:  # this rank's own copy of each bucket, for the TP rank on its GPU
                    self.ipc.serve(weight_sync.pack_buckets(named, self.r.sync_bucket_mb << 20, self.dtype))
                return None
            return weight_sync.push(self.engine, named, version, self.r.sync_bucket_mb << 20)
        finally:
            # Every model-parallel rank runs the export to its end in step with the others: ranks without an
            # engine, an engine that takes no buckets, and a push that failed part way (its error is then raised
            # on this rank, not a hang in the others' next gather). After an error of the export itself the
            # generator is finished and this is a no-op.
            for _ in named:
                pass

    def _push_adapters(self, version: int) -> dict[str, float]:
        """--lora-weight-sync adapter: the base weights at the first sync, then the adapters of `version` (every
        rank of the replica calls it: both exports are collective)."""
        base = None
        if not self.base_sent:
            base = self._push(version, merge_adapters=False)
            self.base_sent = True
        tensors, config = self.actor.peft_adapters()
        if self.engine is None:
            return {}
        stats = weight_sync.push_adapter(self.engine, tensors, config, version)
        return (stats if base is None else base.plus(stats)).metrics()

    def check_probe(self) -> dict[str, float]:
        """The engine scores the last sync's probe (at most once); raises `WeightSyncError` on a mismatch. The
        metrics name the version checked (`sync_probe_version`): the sync before the rollout that follows."""
        probe, self.pending = self.pending, None
        side, self.pending_mismatch = self.pending_mismatch, None
        if self.engine is None:
            return {}
        metrics = {} if side is None else mismatch.engine_side(as_engine(self.engine), side, self.r.mismatch_check_topk)
        if probe is None:
            return metrics
        return {**metrics, **engine_check(self.engine, probe, self.r.verify_sync_tolerance),
                "sync_probe_version": probe.version}


def actor_probe(actor: MegatronPolicy, version: int, gather: bool = True) -> Probe | None:
    """The actor's log-probs on the probe sequence of `version`, on the model-parallel leader (None elsewhere).
    Every model-parallel rank calls this: the forward is collective, and with `gather` the log-probs (on the last
    pipeline stage) are gathered to the leader."""
    probe = weight_sync.probe_sequence(actor.shape.vocab_size, seed=version)
    logp = actor.logprobs(torch.tensor([probe], device=parallel.device()), micro_batch_size=1, temperature=1.0)
    if not gather:
        return Probe(version, probe, logp[0].cpu())
    gathered = [None] * dist.get_world_size(parallel.mp_group())
    dist.all_gather_object(gathered, None if logp is None else logp.cpu(), group=parallel.mp_group())
    return Probe(version, probe, next(g for g in gathered if g is not None)[0])


def engine_check(engine: RolloutEngine, probe: Probe, tolerance: float) -> dict[str, float]:
    """The engine's log-probs on `probe` against the actor's (`weight_sync.check_probe`); the engine must hold
    its KV cache (`enter_rollout`)."""
    engine_logp = torch.tensor(engine.score([probe.tokens], [1], temperature=1.0)[0])
    return weight_sync.check_probe(probe.actor_logp, engine_logp, tolerance)


def verify_sync(actor: MegatronPolicy, engine: RolloutEngine | None, version: int,
                tolerance: float) -> dict[str, float]:
    """Both halves of the check at once, for a caller that has already handed the engine its memory (the actor's
    forward is collective: all model-parallel ranks call this). Raises `WeightSyncError` on a mismatch."""
    probe = actor_probe(actor, version)
    if engine is None:
        return {}
    engine.resume_memory()  # scoring needs the KV cache
    return engine_check(engine, probe, tolerance)
