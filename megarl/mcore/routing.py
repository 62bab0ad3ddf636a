"""Rollout routing replay for mixture-of-experts actors, and the routing metrics.

The engine that sampled a response chose each token's experts with its own numerics (bf16, another kernel); the
actor recomputing the token's log-prob in fp32 can pick other experts where two router scores are close, and the
log-prob then differs by far more than rounding. With `--routing-replay` the actor's routers take the engine's
experts (`Completion.routed_experts`, packed as the batch's `routing`) instead of their own top-k: the
probabilities still come from the actor's router logits (gathered at the replayed experts, renormalised as the
model does), so the router keeps its gradient. Without it the engine's experts are only compared.

Each Megatron `TopKRouter` gets a `RouterTap` in its `router_replay` slot, which megatron-core's top-k routing
calls (`moe_utils.topk_routing_with_score_function`); `set_routing` hands every tap its micro-batch's experts
before the forward. A tap counts, per (token, sparse layer): the router's entropy over all experts, the expert
loads (of the experts used), whether the top-k set the actor used differs from the engine's (0 under replay), and
whether replay overrode the actor's own top-k (what the disagreement would have been). Tokens without engine
experts (padding, each row's last token, which the engine never ran) are left out of the metrics and routed by
the actor itself.
"""

from __future__ import annotations

import torch

from megarl.model_shape import ModelShape


class RouterTap:
    """One router's replay slot (the interface of megatron-core's `RouterReplay.get_replay_topk`)."""

    def __init__(self, pre_softmax: bool, sigmoid: bool = False):
        self.pre_softmax = pre_softmax  # scores are softmax probabilities (else logits)
        # scores are sigmoid scores plus the expert bias (DeepSeek): the entropy is that of the scores normalised
        # to sum 1 (a softmax over numbers in 0..1 would be near-uniform whatever the router does)
        self.sigmoid = sigmoid
        self.replay = False
        self.target: torch.Tensor | None = None  # [tokens, k] the engine's experts, -1 where it has none
        self.reset()

    def reset(self) -> None:
        self.tokens = 0.0
        self.entropy_sum = 0.0
        self.disagree = 0.0
        self.overridden = 0.0
        self.load: torch.Tensor | None = None  # [experts] tokens routed to each, over this step's micro-batches

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, experts = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, experts
        target = self.target.to(scores.device)
        if target.shape != experts.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} engine experts for {tuple(experts.shape)} "
                             "router choices (tokens x top-k); the batch's routing does not match its tokens")
        known = target[:, 0] >= 0
        used = torch.where(known[:, None], target, experts) if self.replay else experts
        with torch.no_grad():
            probs = scores.detach().float()
            if self.sigmoid:
                probs = probs.clamp_min(0)
                probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            elif not self.pre_softmax:
                probs = probs.softmax(dim=-1)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
            target_set = target.sort(dim=-1).values
            own = (experts.sort(dim=-1).values == target_set).all(dim=-1)
            same = (used.sort(dim=-1).values == target_set).all(dim=-1)
            self.tokens += float(known.sum())
            self.entropy_sum += float(entropy[known].sum())
            self.disagree += float((~same & known).sum())
            if self.replay:
                self.overridden += float((~own & known).sum())
            load = torch.bincount(used[known].flatten(), minlength=scores.shape[-1]).double().cpu()
            self.load = load if self.load is None else self.load + load
        if not self.replay:
            return values, experts
        return scores.gather(1, used), used


def install_taps(model: torch.nn.Module, shape: ModelShape, pre_softmax: bool) -> list[tuple[int, RouterTap]]:
    """A `RouterTap` in every router of this pipeline stage's `model`; [(sparse-layer index, tap)] in layer order,
    the index being the layer's position among the model's sparse layers (`ModelShape.moe_layers`)."""
    from megarl.mcore.convert import unwrap

    taps = []
    for layer in unwrap(model).decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        tap = RouterTap(pre_softmax, sigmoid=shape.moe_score_function == "sigmoid")
        router.router_replay = tap
        taps.append((shape.moe_layers.index(layer.layer_number - 1), tap))
    return taps


def set_routing(taps: list[tuple[int, RouterTap]], routing: torch.Tensor | None, replay: bool, sp_rank: int = 0,
                sp_size: int = 1) -> None:
    """Hand each tap its experts for the next forward: `routing` [b, s, sparse layers, k] (the micro-batch's, at
    the width the model runs) in the router's token order (sequence-major, and this rank's slice of the sequence
    under sequence parallelism); None: the actor routes by itself and nothing is counted."""
    for index, tap in taps:
        tap.replay = replay
        if routing is None:
            tap.target = None
            continue
        per_layer = routing[:, :, index]  # [b, s, k]
        if sp_size > 1:
            per_layer = per_layer.chunk(sp_size, dim=1)[sp_rank]
        tap.target = per_layer.transpose(0, 1).reshape(-1, per_layer.shape[-1]).long()


def take_metrics(taps: list[tuple[int, RouterTap]]) -> dict[str, float]:
    """This stage's sums since the last call (then reset): (token, layer) pairs compared, their router entropy
    (nats), those whose top-k used differs from the engine's, those where replay overrode the actor's own top-k,
    and the expert-load imbalance (max / mean load) of each layer, summed over layers (`router_layers` of them)."""
    out = {"router_tokens": 0.0, "router_entropy_sum": 0.0, "routing_disagree_sum": 0.0,
           "routing_replayed_sum": 0.0, "router_imbalance_sum": 0.0, "router_layers": 0.0}
    for _, tap in taps:
        out["router_tokens"] += tap.tokens
        out["router_entropy_sum"] += tap.entropy_sum
        out["routing_disagree_sum"] += tap.disagree
        out["routing_replayed_sum"] += tap.overridden
        if tap.load is not None and tap.load.sum() > 0:
            out["router_imbalance_sum"] += float(tap.load.max() / tap.load.mean())
            out["router_layers"] += 1
        tap.reset()
    return out
