"""The critic of advantage estimators that need one (`Needs(critic=True)`; built in: `gae`, PPO).

The four models of PPO are the actor, the frozen reference (when `--kl-coef > 0`), the reward (the verifiers)
and the critic, a Megatron value model (`megarl.mcore.critic`) trained colocated with the actor, on the same
ranks and the same TP x PP x DP layout, with its own optimizer. Each step, after the log-probs:

    values   V = critic(rollout tokens)                       [B, S - 1], the state before each response token
    A        the registered estimator of the final rewards and V (GAE: the score on the last response token)
    returns  R = A + V                                         the critic's regression target
    whiten   A over all response tokens of the global batch    (`--gae-whiten`)
    critic   `--updates-per-rollout` steps on 0.5 * max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2), token mean

and the actor then trains on the token-level advantages `A` as usual. The critic's checkpoint is saved under
`<save>/critic/` by the same code as the actor's, before the actor's, so the actor's `latest` step always has a
complete critic checkpoint next to it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algorithms import ADVANTAGES, AdvantageFn
from megarl.algorithms.gae import gae_returns, masked_moments, mean_var, value_loss_clipped, whiten
from megarl.config import Config
from megarl.errors import ConfigError
from megarl.mcore import checkpoint, parallel
from megarl.mcore.base_model import OptimConfig
from megarl.mcore.critic import MegatronCritic
from megarl.mcore.model import MoEOptions
from megarl.mcore.parallel import ParallelInfo
from megarl.metrics import reduce_over_ranks
from megarl.model_shape import ModelShape
from megarl.samples import PackedSamples

CRITIC_DIR = "critic"
_SUM_KEYS = ["value_loss_num", "value_tokens", "value_clipped", "n", "v_sum", "r_sum", "r_sq", "e_sum", "e_sq"]


class CriticStage:
    """The critic stage (see the module docstring; the value model itself is `MegatronCritic`): built from the
    actor's checkpoint, or from the critic's own checkpoint when resuming; its state is saved under
    `<save>/critic/`."""

    def __init__(self, cfg: Config, shape: ModelShape, info: ParallelInfo, actor_optim: OptimConfig,
                 padded_vocab_size: int, resumed_from: Path | None = None):
        """`resumed_from`: the actor's checkpoint (`<save>/iter_N`) the run resumes from; None = a fresh start."""
        m, t = cfg.model, cfg.training
        self.cfg, self.info = cfg, info
        # PPO's critic: it whitens and clips as the `gae` estimator's options say (`--gae-whiten`, `--value-clip`).
        self.options = ADVANTAGES.settings(cfg, "gae")
        # Same schedule shape as the actor's, scaled to the critic's learning rate.
        optim = replace(actor_optim, lr=t.critic_lr, min_lr=t.critic_lr * t.min_lr / t.lr)
        self.model = MegatronCritic(shape, tp=info.tp_size, pp=info.pp_size, optim=optim, bf16=m.bf16,
                                    use_transformer_engine=m.use_transformer_engine,
                                    padded_vocab_size=padded_vocab_size,
                                    recompute_granularity=m.recompute_granularity, moe=MoEOptions.from_config(m))
        if resumed_from is not None:
            path = resumed_from.parent / CRITIC_DIR / resumed_from.name
            if not path.is_dir():
                raise ConfigError(f"--load {cfg.checkpoint.load}: no critic checkpoint for {resumed_from.name} "
                                  f"({path}); was it saved by a run whose advantage estimator needs a critic?")
            checkpoint.load(path, self.model, load_rng=False)  # the actor's checkpoint holds the RNG states
        else:
            self.model.load_hf(m.hf_checkpoint)

    def save(self, root: str, step: int, keep_last: int) -> None:
        """Collective. Called before the actor's checkpoint (see the module docstring)."""
        checkpoint.save(Path(root) / CRITIC_DIR, step, self.model, {}, keep_last=keep_last)

    def advantages_and_update(self, estimator: AdvantageFn, rewards: torch.Tensor, packed: PackedSamples,
                              inputs: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-level advantages [B, S - 1] from the critic's values, then the critic's own update on this batch.

        Collective (every rank calls it). Values, and so advantages, exist on the last pipeline stage, the only
        place the actor's loss reads them; other stages get zeros. Returns the advantages and the step's critic
        metrics, reduced over ranks, for the metrics row."""
        a, t, info = self.cfg.algorithm, self.cfg.training, self.info
        start = time.perf_counter()
        mask = packed.loss_mask
        budget = dict(micro_batch_size=t.micro_batch_size, max_tokens_per_micro_batch=t.max_tokens_per_micro_batch)
        values = self.model.values(packed.tokens, lengths=packed.lengths, **budget)
        if values is None:
            values = advantages = returns = torch.zeros_like(mask)
        else:
            values = values.to(mask.device)  # the model's device; the batch and the estimator stay on the CPU
            values = torch.where(mask.bool(), values, torch.zeros_like(values))
            advantages = estimator(rewards, a.advantage_eps, values=values, **inputs)
            returns = gae_returns(advantages, values, mask)
        if self.options.gae_whiten:
            # Over the global batch: each DP rank's tokens are counted once per TP rank of the last stage, the same
            # factor for every sample, so mean and variance are those of the global batch.
            moments = masked_moments(advantages, mask) if info.is_last_stage else torch.zeros(3, dtype=torch.float64)
            moments = moments.to(parallel.device())  # NCCL reduces device tensors only
            dist.all_reduce(moments)
            mean, var = mean_var(moments.cpu())
            advantages = whiten(advantages, mask, mean, var)
        metrics = self._metrics(mask, values, returns, self._update(packed, values, returns, budget))
        return advantages.float(), {**metrics, "t_critic": time.perf_counter() - start}

    def _update(self, packed: PackedSamples, values: torch.Tensor, returns: torch.Tensor, budget: dict) -> dict:
        """`--updates-per-rollout` optimizer steps of the critic over consecutive slices of this rank's batch."""
        batch = {"tokens": packed.tokens, "loss_mask": packed.loss_mask, "returns": returns.float(),
                 "old_values": values, "lengths": packed.lengths}
        k = self.cfg.training.updates_per_rollout
        size = packed.loss_mask.shape[0] // k
        totals: dict[str, float] = {}
        for i in range(k):
            mini = {key: v[i * size : (i + 1) * size] for key, v in batch.items()}
            out = self.model.train_step(mini, value_loss_fn(self.options.value_clip), **budget)
            for key, v in out.items():
                totals[key] = totals.get(key, 0.0) + v
        return {**totals, "grad_norm": totals.get("grad_norm", float("nan")) / k, "lr": out["lr"]}

    def _metrics(self, mask: torch.Tensor, values: torch.Tensor, returns: torch.Tensor, totals: dict) -> dict:
        local: dict[str, float] = {}
        if self.info.is_last_stage and self.info.tp_rank == 0:
            m = mask.bool()
            v, r = values[m].double(), returns[m].double()
            local = {key: totals.get(key, 0.0) for key in ("value_loss_num", "value_tokens", "value_clipped")}
            local.update(n=float(m.sum()), v_sum=float(v.sum()), r_sum=float(r.sum()), r_sq=float(r.square().sum()),
                         e_sum=float((r - v).sum()), e_sq=float((r - v).square().sum()))
        g = reduce_over_ranks(local, _SUM_KEYS)
        n, tok = max(g["n"], 1.0), max(g["value_tokens"], 1.0)
        var_r = g["r_sq"] / n - (g["r_sum"] / n) ** 2
        var_e = g["e_sq"] / n - (g["e_sum"] / n) ** 2
        return {
            "value_loss": g["value_loss_num"] / tok, "value_clip_frac": g["value_clipped"] / tok,
            "value_mean": g["v_sum"] / n, "return_mean": g["r_sum"] / n,
            # 1 - Var(R - V) / Var(R) of the values that produced this step's advantages: 1 is a perfect critic,
            # 0 no better than a constant, negative worse than one.
            "explained_variance": 1.0 - var_e / var_r if var_r > 1e-12 else 0.0,
            "critic_grad_norm": totals["grad_norm"], "critic_lr": totals["lr"],
        }


Critic = CriticStage  # the old name, beside `MegatronCritic` (the model); removed in megarl 0.3


def value_loss_fn(clip: float):
    """The critic's `loss_fn(values, micro_batch) -> (loss sum, token count, metrics)`."""

    def loss_fn(values: torch.Tensor, mb: dict):
        n = mb["_real_rows"]
        values, mask = values[:n], mb["loss_mask"][:n]
        per_token, m = value_loss_clipped(values, mb["old_values"][:n], mb["returns"][:n], mask, clip)
        num, den = per_token.sum(), mask.sum()
        return num, den, {"value_loss_num": num.detach(), "value_tokens": den.detach(), "value_clipped": m["clipped"]}

    return loss_fn
