"""Who holds the accelerator, and the weight sync: one step is enter_rollout -> generate -> enter_training -> train
-> sync.

With `--offload-optimizer` / `--offload-params` the actor moves its state off the GPU while the engine generates;
the engine releases its KV cache (and weights) while the actor trains. After every update the actor's weights go
to the engine as HF-named tensors in buckets (`megarl.rollout.weight_sync`), or, for an engine that generates with
the actor's own parameters, only a new version. On CPU every one of these is a no-op but the sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.config import RolloutConfig, TrainingConfig
from megarl.mcore import parallel
from megarl.mcore.actor import MegatronPolicy
from megarl.mcore.parallel import ParallelInfo
from megarl.rollout import RolloutEngine, weight_sync


def enter_rollout(actor: MegatronPolicy, engine: RolloutEngine | None, t: TrainingConfig) -> None:
    """Hand the GPU to the engine: offload the actor (per --offload-optimizer / --offload-params), then the engine
    re-acquires its KV cache and flushes prefixes cached under the old weights."""
    if t.offload_optimizer or t.offload_params:
        actor.offload(params=t.offload_params, optimizer=t.offload_optimizer)
    if engine is not None:
        engine.resume_memory()


def enter_training(actor: MegatronPolicy, engine: RolloutEngine | None) -> None:
    """Hand the GPU to the actor: the engine releases its KV cache and weights, the actor takes back what it
    offloaded."""
    if engine is not None:
        engine.release_memory()
    actor.onload()


class WeightSync:
    """The actor -> engine sync of a model replica; every rank of the replica calls it (the export is collective).

    Whether weights move at all is the engine's to say (`shares_actor_weights`); the replica's leader holds the
    engine and tells the other ranks once."""

    def __init__(self, actor: MegatronPolicy, engine: RolloutEngine | None, r: RolloutConfig, info: ParallelInfo):
        self.actor, self.engine, self.r = actor, engine, r
        shares = engine.shares_actor_weights if engine is not None else None
        self.shares_actor_weights = parallel.broadcast_in_mp_group(shares) if info.replica_size > 1 else shares

    def __call__(self, version: int) -> dict[str, float]:
        """Sync the actor's weights as `version`; with --verify-weight-sync compare log-probs on a probe
        sequence. Returns the sync's metrics on the leader ({} elsewhere)."""
        if self.shares_actor_weights:
            metrics = weight_sync.stamp(self.engine, version).metrics() if self.engine is not None else {}
        else:
            named = self.actor.export_hf()  # gathers TP/PP shards on the leader; collective
            metrics = (weight_sync.push(self.engine, named, version, self.r.sync_bucket_mb << 20).metrics()
                       if self.engine is not None else {})
            del named
        if self.r.verify_weight_sync:
            metrics.update(verify_sync(self.actor, self.engine, version, self.r.verify_sync_tolerance))
        return metrics


def verify_sync(actor: MegatronPolicy, engine: RolloutEngine | None, version: int,
                tolerance: float) -> dict[str, float]:
    """The actor's and the engine's log-probs on one probe sequence must agree (all model-parallel ranks call
    this: the actor's forward is collective). Raises `WeightSyncError` on a mismatch."""
    probe = weight_sync.probe_sequence(actor.shape.vocab_size, seed=version)
    logp = actor.logprobs(torch.tensor([probe], device=parallel.device()), micro_batch_size=1, temperature=1.0)
    gathered = [None] * dist.get_world_size(parallel.mp_group())
    dist.all_gather_object(gathered, None if logp is None else logp.cpu(), group=parallel.mp_group())
    if engine is None:
        return {}
    engine.resume_memory()  # scoring needs the KV cache
    actor_logp = next(g for g in gathered if g is not None)[0]
    engine_logp = torch.tensor(engine.score([probe], [1], temperature=1.0)[0])
    return weight_sync.check_probe(actor_logp, engine_logp, tolerance)
