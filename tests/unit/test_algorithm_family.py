"""The algorithm family against hand computations: RLOO, REINFORCE++, dual-clip, GSPO, TIS, entropy bonus,
aggregation modes, DAPO's overlong shaping, truncation masking and dynamic sampling."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megarl.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    aggregate,
    grpo_token_loss,
    policy_loss_dual_clip,
    policy_loss_gspo,
    truncated_is_weights,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# -- advantages -------------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline():
    adv = ADVANTAGES.get("rloo").fn(t([1.0, 0.0, 0.0, 1.0]))
    # i=0: baseline (0 + 0 + 1) / 3 = 1/3 -> 2/3; i=1: baseline (1 + 0 + 1) / 3 = 2/3 -> -2/3
    torch.testing.assert_close(adv, t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_rloo_group_of_one_and_equal_rewards_are_zero():
    fn = ADVANTAGES.get("rloo").fn
    assert torch.equal(fn(t([1.0], [0.0])), torch.zeros(2, 1))
    assert torch.equal(fn(t([0.3, 0.3, 0.3])), torch.zeros(1, 3))


def test_reinforce_pp_whitens_over_the_batch():
    adv = ADVANTAGES.get("reinforce_pp").fn(t([1.0, 0.0], [1.0, 1.0]), eps=0.0)
    # batch mean 0.75; unbiased std sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5
    torch.testing.assert_close(adv, t([0.5, -1.5], [0.5, 0.5]))
    assert torch.equal(ADVANTAGES.get("reinforce_pp").fn(t([2.0, 2.0], [2.0, 2.0])), torch.zeros(2, 2))


def test_reinforce_pp_baseline_centres_per_group_then_divides_by_batch_std():
    adv = ADVANTAGES.get("reinforce_pp_baseline").fn(t([1.0, 0.0], [1.0, 1.0]), eps=0.0)
    std = math.sqrt((0.25 + 0.25) / 3)  # centred values 0.5, -0.5, 0, 0 (mean 0, n - 1 = 3)
    torch.testing.assert_close(adv, t([0.5 / std, -0.5 / std], [0.0, 0.0]))


def test_advantage_registry_lists_valid_names():
    with pytest.raises(ValueError, match="rloo"):
        ADVANTAGES.get("no-such-estimator")


# -- policy losses ----------------------------------------------------------------------------------------------


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 3)
    logp = torch.log(t([5.0, 2.0, 5.0])).requires_grad_()
    adv = torch.tensor([-1.0])
    loss, m = policy_loss_dual_clip(logp, old, adv, torch.ones(1, 3), 0.2, 0.2, clip_ratio_c=3.0)
    # ratio 5, A=-1: PPO clip gives max(5, 0.8 * ... ) = 5 > cap 3 -> 3 (no gradient); ratio 2: 2 < 3 stays
    torch.testing.assert_close(loss.detach(), t([3.0, 2.0, 3.0]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([0.0, 2.0, 0.0]))  # d(-ratio * A)/dlogp = ratio for A = -1
    assert m["clip_frac_dual"] == pytest.approx(2 / 3)


def test_dual_clip_leaves_positive_advantages_alone():
    old = torch.zeros(1, 2)
    logp = torch.log(t([5.0, 0.9]))
    clip, _ = POLICY_LOSSES.get("clip")(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    dual, _ = POLICY_LOSSES.get("dual_clip")(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    assert torch.equal(clip, dual)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss_dual_clip(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), clip_ratio_c=1.0)


def test_gspo_uses_one_sequence_ratio_per_response():
    old = torch.zeros(2, 3)
    logp = t([0.1, 0.3, 9.0], [0.2, -0.2, 0.0]).requires_grad_()
    mask = t([1, 1, 0], [1, 1, 1])
    adv = torch.tensor([2.0, -1.0])
    loss, _ = policy_loss_gspo(logp, old, adv, mask, clip_low=10.0, clip_high=10.0)  # no clipping here
    s0, s1 = math.exp(0.2), math.exp(0.0)  # geometric means over masked tokens; the padded 9.0 is ignored
    torch.testing.assert_close(loss.detach(), t([-2 * s0, -2 * s0, 0.0], [s1, s1, s1]))
    loss.sum().backward()
    # GSPO-token: d/dlogp_t of -sg(s) * exp(logp_t - sg(logp_t)) * A is -s * A
    torch.testing.assert_close(logp.grad, t([-2 * s0, -2 * s0, 0.0], [s1, s1, s1]))


def test_gspo_clips_the_sequence_ratio():
    old = torch.zeros(1, 2)
    logp = t([0.01, 0.01]).requires_grad_()  # s = e^0.01 > 1 + 4e-4
    loss, m = policy_loss_gspo(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
    torch.testing.assert_close(loss.detach(), t([-(1 + 4e-4), -(1 + 4e-4)]))
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    assert m["clip_frac"] == 1.0


def test_truncated_importance_weights():
    old = torch.log(t([0.5, 0.5, 0.5]))
    rollout = torch.log(t([0.5, 0.1, 0.4]))
    w, m = truncated_is_weights(old, rollout, t([1, 1, 0]), cap=2.0)
    torch.testing.assert_close(w, t([1.0, 2.0, 1.0]))  # 0.5/0.1 = 5 -> capped at 2; masked -> 1
    assert m["tis_clip_frac"] == 0.5 and m["tis_weight_max"] == 2.0


def test_tis_scales_the_policy_gradient_per_token():
    logp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.log(t([0.5, 4.0]))  # weights exp(0 - log 0.5) = 2 -> capped 1.5, exp(-log 4) = 0.25
    loss, _ = grpo_token_loss(logp, logp.detach(), None, torch.tensor([1.0]), torch.ones(1, 2),
                              rollout_logp=rollout, off_policy_correction="tis", is_cap=1.5)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([-1.5, -0.25]))
    with pytest.raises(ValueError, match="rollout"):
        grpo_token_loss(logp, logp.detach(), None, torch.tensor([1.0]), torch.ones(1, 2), off_policy_correction="tis",
                        is_cap=1.5)


def test_entropy_bonus_is_subtracted_per_token():
    logp = torch.zeros(1, 2, requires_grad=True)
    entropy = t([0.5, 1.5]).requires_grad_()
    loss, m = grpo_token_loss(logp, logp.detach(), None, torch.tensor([0.0]), t([1, 0]), entropy=entropy,
                              entropy_coef=0.1)
    torch.testing.assert_close(loss.detach(), t([-0.05, 0.0]))
    assert m["entropy_mean"] == pytest.approx(0.5)
    loss.sum().backward()
    torch.testing.assert_close(entropy.grad, t([-0.1, 0.0]))


# -- aggregation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,num,den", [
    ("token-mean", 1 + 2 + 3 + 4 + 5, 5),
    ("seq-mean-token-mean", (1 + 2) / 2 + (3 + 4 + 5) / 3, 3),  # the empty third row counts in B
    ("seq-mean-token-sum", 15, 3),
    ("seq-mean-token-sum-norm", 15, 3 * 4),
])
def test_aggregation_modes(mode, num, den):
    loss = t([1, 2, 9, 9], [3, 4, 5, 9], [9, 9, 9, 9])
    mask = t([1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0])
    n, d = aggregate(loss, mask, mode, max_len=4)
    assert float(n) == pytest.approx(num) and float(d) == pytest.approx(den)


def test_dr_grpo_normaliser_needs_max_len():
    with pytest.raises(ValueError, match="max_len"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "nope")


def test_fully_masked_micro_batch_gives_zero_loss_and_finite_grad():
    logp = torch.full((2, 3), float("-inf")).requires_grad_()
    loss, m = grpo_token_loss(logp, torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]),
                              torch.zeros(2, 3), kl_coef=0.1, policy_loss="dual_clip")
    n, d = aggregate(loss, torch.zeros(2, 3), "token-mean")
    n.backward()
    assert float(n.detach()) == 0.0 and float(d) == 0.0 and torch.isfinite(logp.grad).all()


# -- DAPO: overlong shaping, dynamic sampling (truncation masking: tests/unit/test_samples.py) ----------------------


def _cfg(**algo):
    from megarl.config import SECTIONS, Config

    cfg = Config(**{name: cls() for name, cls in SECTIONS.items()})
    for k, v in algo.items():
        setattr(cfg.algorithm, k, v)
    return cfg


def _sample(n_tokens, reward=1.0, outcome="correct", group=0):
    from megarl.samples import Sample, SampleStatus

    return Sample(group=group, prompt_index=0, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n_tokens)),
                  loss_mask=[1] * n_tokens, rollout_logprobs=[-0.5] * n_tokens, weight_version=0,
                  status=SampleStatus.COMPLETED, reward=reward, outcome=outcome)


class _Fixed:
    """A collect stage that returns one fixed batch."""

    def __init__(self, rollout):
        self.rollout = rollout

    def __call__(self, step):
        return self.rollout


def test_overlong_reward_shaping_returns_new_samples():
    from megarl.stages.collect import OverlongShaping
    from megarl.samples import RolloutBatch

    inner = RolloutBatch([_sample(4), _sample(6), _sample(8), _sample(6, reward=0.0, outcome="incorrect")], 4)
    shaped = OverlongShaping(_Fixed(inner), max_len=8, buffer_len=4, penalty=1.0)(step=0)
    # Lmax - buffer = 4: length 4 -> 0; 6 -> -(6 - 4) / 4; 8 -> -1
    assert [s.reward for s in shaped.samples] == [1.0, 0.5, 0.0, -0.5]
    assert [s.outcome for s in shaped.samples] == ["correct", "correct", "correct", "incorrect"]  # outcomes untouched
    assert [s.reward for s in inner.samples] == [1.0, 1.0, 1.0, 0.0], "the inner stage's output is not written to"


class _Tok:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


class _FakeEngine:
    """Prompt [k]: k % 3 == 0 -> every sample right, 1 -> every sample wrong, 2 -> half right."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        from megarl.rollout.base import Completion

        self.calls += 1
        out = []
        for p in prompts:
            kind = p[0] % 3
            texts = ["5" if kind == 0 or (kind == 2 and i % 2 == 0) else "4" for i in range(params.n)]
            out.append([Completion([ord(c) for c in txt] + [0], [-0.1, -0.1], "stop") for txt in texts])
        return out


def _dynamic_sampling(prompts, engine, cfg):
    from megarl.data import PromptSampler
    from megarl.mcore.parallel import ParallelInfo
    from megarl.reward import InProcessReward
    from megarl.rollout import single_turn
    from megarl.stages.collect import Collector, DynamicSampling

    info = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    collector = Collector(engine, single_turn, InProcessReward(), _Tok(), prompts,
                          PromptSampler(len(prompts), seed=0, shuffle=False), cfg.rollout, cfg.data.rollout_batch_size,
                          seed=0, info=info)
    return DynamicSampling(collector, cfg.algorithm.max_sampling_rounds)


def test_dynamic_sampling_drops_uniform_groups_and_refills(one_rank_group):
    from megarl.data import PromptRecord

    prompts = [PromptRecord(i, str(i), [i], "5", "arithmetic") for i in range(30)]
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=4)
    cfg.data.rollout_batch_size, cfg.rollout.n_samples_per_prompt = 4, 4
    engine = _FakeEngine()
    stage = _dynamic_sampling(prompts, engine, cfg)
    rb = stage(0)
    # Prompts 0..3 (round 1): only 2 is mixed. 4..7: 5 mixed. 8..11: 8, 11 mixed -> 4 kept after 3 rounds.
    assert engine.calls == 3 and rb.metrics["ds_rounds"] == 3 and rb.metrics["ds_prompts_drawn"] == 12
    assert rb.metrics["ds_groups_dropped"] == 8 and rb.metrics["ds_groups_filled"] == 0
    kept = sorted({s.prompt_index for s in rb.samples})
    assert kept == [2, 5, 8, 11] and len(rb.samples) == 16
    assert [s.group for s in rb.samples] == [g for g in range(4) for _ in range(4)]
    assert all(len({s.outcome for s in rb.samples[i : i + 4]}) == 2 for i in range(0, 16, 4))
    assert stage.rank_state() == {"ds_buffer": []}


def test_dynamic_sampling_fills_with_dropped_groups_when_rounds_run_out(one_rank_group):
    from megarl.data import PromptRecord
    from megarl.stages.algorithm import Algorithm, pack

    prompts = [PromptRecord(i, str(i), [3 * i], "5", "arithmetic") for i in range(30)]  # all solved every time
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=2)
    cfg.data.rollout_batch_size, cfg.rollout.n_samples_per_prompt = 2, 2
    rb = _dynamic_sampling(prompts, _FakeEngine(), cfg)(0)
    assert rb.metrics["ds_rounds"] == 2 and rb.metrics["ds_groups_filled"] == 2 and len(rb.samples) == 4
    packed = pack(rb.samples, 0)
    info = SimpleNamespace(pp_size=1)
    rewards = torch.tensor([s.reward for s in rb.samples])
    assert rewards.tolist() == [1.0] * 4
    advantages, _ = Algorithm(cfg, info, None, None).advantages(rewards, packed, None, rb.group_size)
    assert torch.equal(advantages, torch.zeros(4))


def test_each_estimator_and_policy_loss_gets_its_own_options_only(monkeypatch):
    """The trainer calls the chosen estimator with its own options and no other's (GAE's gamma and lambda go to gae
    alone), and the actor's loss gives the chosen policy loss its own (dual-clip's cap to dual_clip alone)."""
    from dataclasses import dataclass

    from megarl.algorithms import ADVANTAGES, POLICY_LOSSES, AdvantageEstimator, Needs
    from megarl.arguments import components
    from megarl.config import build_config
    from megarl.registry import option
    from megarl.stages.algorithm import Algorithm
    from megarl.stages.update import make_loss_fn

    @dataclass
    class ProbeOptions:
        probe_scale: float = option(2.0, "probe: a scale")

    seen = []

    def probe(rewards, eps=1e-6, **inputs):
        seen.append(inputs)
        return rewards - rewards.mean(dim=1, keepdim=True)

    monkeypatch.setitem(ADVANTAGES._items, "probe", AdvantageEstimator("probe", probe, Needs()))
    monkeypatch.setitem(ADVANTAGES._options, "probe", ProbeOptions)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    for values, want in (({"advantage_estimator": "probe", "probe_scale": 3.0, "gae_gamma": 0.5}, {"probe_scale": 3.0}),
                         ({"advantage_estimator": "probe"}, {"probe_scale": 2.0})):
        cfg = build_config(values, {**components(), "advantage_estimator.probe": ProbeOptions})
        Algorithm(cfg, SimpleNamespace(pp_size=1), None, None).advantages(rewards, None, None, group_size=2)
        assert seen.pop() == want
    calls = []

    def recording(loss):
        def call(*args, **kw):
            calls.append(kw)
            return loss(*args, **kw)
        return call

    for name in ("clip", "dual_clip"):
        monkeypatch.setitem(POLICY_LOSSES._items, name, recording(POLICY_LOSSES.get(name)))
    for name in ("clip", "dual_clip"):
        cfg = build_config({"policy_loss": name, "clip_ratio_c": 2.5}, components())
        logp = torch.zeros(1, 3)
        mb = {"_real_rows": 1, "loss_mask": torch.ones(1, 3), "advantages": torch.ones(1), "rollout_logp": logp}
        make_loss_fn(cfg.algorithm, 3, cfg)(logp, mb)
    assert calls == [{}, {"clip_ratio_c": 2.5}]
