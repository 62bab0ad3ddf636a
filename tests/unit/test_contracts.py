"""Contracts of every extension hook, looped over every entry of its registry (a plugin's entry included, once it
is registered): advantage estimators, policy losses, KL estimators, loss aggregation modes, verifiers and the
rollout-engine backends this machine can run. Values are checked against what each contract promises, not
against an implementation: shapes, zeros where nothing is learnt, finiteness where padding holds garbage.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    ADVANTAGES,
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    aggregate,
    grpo_token_loss,
)

B, T = 6, 5
# REINFORCE++ whitens over the whole batch, with no per-prompt baseline (its docstring): a group of equal rewards
# among other groups gets the batch's advantage, not 0. It promises 0 only when the whole batch is equal.
BATCH_BASELINE = {"reinforce_pp"}


def _mask() -> torch.Tensor:
    """Response tokens of 6 rows: full, ragged, one token, and one row with none (padding only)."""
    lengths = [5, 3, 1, 0, 4, 2]
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def _garbage_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with padding positions holding what real padding holds: -inf, nan, huge."""
    junk = torch.tensor([-math.inf, math.nan, 1e30, -1e30])
    fill = junk[torch.arange(x.numel()) % 4].view_as(x)
    return torch.where(mask, x, fill)


def _inputs(needs, mask: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(3)
    out: dict = {}
    if needs.token_level:
        out.update(mask=mask.float(), gamma=1.0, lam=0.95)
    if needs.critic:
        out["values"] = torch.where(mask, torch.rand(mask.shape, generator=g), torch.zeros(mask.shape))
    if needs.reference:
        out["ref_logp"] = -torch.rand(mask.shape, generator=g)
    return out


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_advantage_estimator_contract(name):
    est = ADVANTAGES.get(name)
    mask = _mask()
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [0.5, 1.0, 0.0]]).view(-1)[:B]
    grouped = rewards.view(2, 3)
    inputs = _inputs(est.needs, mask)
    if est.needs.token_level:
        adv = est.fn(rewards, 1e-6, **inputs)
        assert adv.shape == (B, T) and torch.isfinite(adv).all()
        assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum()))), "advantages outside the response"
        return
    adv = est.fn(grouped, eps=1e-6, **inputs)
    assert adv.shape == grouped.shape and adv.is_floating_point() and torch.isfinite(adv).all()
    equal = torch.full((4, 3), 0.7)
    assert torch.equal(est.fn(equal, eps=1e-6, **inputs), torch.zeros(4, 3)), "all rewards equal: nothing to learn"
    uniform_groups = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.3]])
    if name not in BATCH_BASELINE:
        assert torch.equal(est.fn(uniform_groups, eps=1e-6, **inputs), torch.zeros(3, 3)), "a uniform group"
    mixed = est.fn(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=1e-6, **inputs)
    assert mixed[0, 0] > 0 > mixed[0, 1], "a better completion gets a larger advantage"


def test_batch_baseline_exceptions_are_registered():
    assert BATCH_BASELINE <= set(ADVANTAGES.names())


def _policy_inputs():
    g = torch.Generator().manual_seed(0)
    mask = _mask()
    logp = _garbage_outside(-torch.rand(B, T, generator=g) * 3, mask).requires_grad_()
    old = _garbage_outside(-torch.rand(B, T, generator=g) * 3, mask)
    adv = torch.randn(B, generator=g)
    return logp, old, adv, mask


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_contract(name):
    logp, old, adv, mask = _policy_inputs()
    per_token, metrics = POLICY_LOSSES.get(name)(logp, old, adv, mask, 0.2, 0.28)
    assert per_token.shape == (B, T) and torch.isfinite(per_token).all()
    assert torch.equal(per_token[~mask], torch.zeros(int((~mask).sum()))), "loss at padding"
    assert all(math.isfinite(float(v)) for v in metrics.values()) and "clip_frac" in metrics
    per_token.sum().backward()
    assert torch.isfinite(logp.grad).all() and torch.equal(logp.grad[~mask], torch.zeros(int((~mask).sum())))
    # Per-token advantages [B, T] are accepted as well as one per sequence.
    tokens, _ = POLICY_LOSSES.get(name)(logp.detach(), old, adv[:, None].expand(B, T), mask, 0.2, 0.28)
    assert torch.allclose(tokens, per_token.detach())
    # At ratio 1 with no advantage there is nothing to learn.
    zero, _ = POLICY_LOSSES.get(name)(logp.detach(), logp.detach(), torch.zeros(B), mask, 0.2, 0.28)
    assert torch.equal(zero, torch.zeros(B, T))


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_contract(name):
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(B, T, generator=g)
    kl = KL_ESTIMATORS.get(name)(logp, logp.clone())
    assert kl.shape == (B, T) and torch.equal(kl, torch.zeros(B, T)), "KL of a policy to itself"
    # Inside the loss, padding that holds garbage gives a finite KL and gradient.
    lp, old, adv, mask = _policy_inputs()
    ref = _garbage_outside(-torch.rand(B, T, generator=g) * 3, mask)
    per_token, metrics = grpo_token_loss(lp, old, ref, adv, mask, kl_coef=0.1, kl_type=name)
    per_token.sum().backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(lp.grad).all() and math.isfinite(metrics["kl_mean"])


def _correction_options(name: str) -> dict:
    """A correction's keyword arguments as a run's config gives them (its defaults; tis needs a cap)."""
    from megarl.arguments import components
    from megarl.config import build_config

    cfg = build_config({"off_policy_correction": name, "tis_cap": 2.0 if name == "tis" else 0.0}, components())
    return OFF_POLICY_CORRECTIONS.kwargs_of(cfg, name)


@pytest.mark.parametrize("correction", OFF_POLICY_CORRECTIONS.names())
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_off_policy_correction_contract(name, correction):
    lp, old, adv, mask = _policy_inputs()
    g = torch.Generator().manual_seed(2)
    behaviour = _garbage_outside(-torch.rand(B, T, generator=g) * 3, mask)
    options = _correction_options(correction)
    per_token, metrics = grpo_token_loss(lp, old, None, adv, mask, policy_loss=name, rollout_logp=behaviour,
                                         off_policy_correction=correction, correction_options=options)
    assert torch.isfinite(per_token).all() and torch.equal(per_token[~mask], torch.zeros(int((~mask).sum())))
    per_token.sum().backward()
    assert torch.isfinite(lp.grad).all() and torch.equal(lp.grad[~mask], torch.zeros(int((~mask).sum())))
    if correction != "none":  # weights are >= 0; the truncated and the dropped shares are shares
        assert 0 <= metrics[f"{correction}_weight_mean"] <= metrics[f"{correction}_weight_max"]
        assert metrics[f"{correction}_weight_max"] <= options.get("cap", options.get("high", math.inf))
        assert 0 <= metrics[f"{correction}_clip_frac"] <= 1 and 0 <= metrics[f"{correction}_masked_frac"] <= 1
    # The behaviour policy equal to the denominator of the ratio: weights 1, the policy loss unchanged.
    same, m = grpo_token_loss(lp.detach(), old, None, adv, mask, policy_loss=name, rollout_logp=old,
                              off_policy_correction=correction, correction_options=options)
    plain, _ = POLICY_LOSSES.get(name)(lp.detach(), old, adv, mask, 0.2, 0.2)
    assert torch.equal(same, plain)
    assert correction == "none" or m[f"{correction}_masked_frac"] == 0 == m[f"{correction}_clip_frac"]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregation_contract(mode):
    lp, old, adv, mask = _policy_inputs()
    per_token, _ = grpo_token_loss(lp, old, None, adv, mask)
    num, den = aggregate(per_token, mask, mode, max_len=T)
    assert num.shape == () and den.shape == () and torch.isfinite(num) and float(den) > 0
    (num / den).backward()
    assert torch.isfinite(lp.grad).all()
    # A micro-batch of padding only adds nothing to the numerator.
    empty = torch.zeros(2, T, dtype=torch.bool)
    n0, d0 = aggregate(torch.zeros(2, T), empty, mode, max_len=T)
    assert float(n0) == 0.0 and math.isfinite(float(d0))


# -- verifiers --------------------------------------------------------------------------------------------------

GARBAGE_RESPONSES = ["", " ", "\x00\x01\x02", "é" * 50, "```python\n", "```\n```", "}{" * 20, "\\boxed{" * 30,
                     "1" * 5000, "$$$$", "None", "def f(:\n  pass"]
GARBAGE_TRUTHS = [None, "", "\x00", 12, -3.5, [], {}, {"test": 5}, {"inputs": "x", "outputs": 3}, [[1, 2], {"a": None}],
                  "{not json", "\\frac{", float("nan")]


def _verifier_names() -> list[str]:
    from megarl.verifiers import VERIFIERS

    return VERIFIERS.names()


# A well-formed ground truth per built-in verifier, for the garbage responses (others get "3").
TRUTH = {"code": {"test": "assert f() == 3", "entry_point": "f"},
         "reasoning_gym": {"task": "chain_sum", "config": {}, "seed": 1, "size": 2, "index": 0}}
# Verifiers that need an optional extra: skipped with its name where it is not installed
EXTRA = {"reasoning_gym": ("reasoning_gym", "the rg extra: pip install megarl[rg]")}


@pytest.mark.parametrize("name", _verifier_names())
def test_verifier_on_garbage_returns_a_result(name):
    from megarl.verifiers import OUTCOMES, VerifyResult, VERIFIERS

    if name in EXTRA:
        pytest.importorskip(EXTRA[name][0], reason=EXTRA[name][1])
    verifier = VERIFIERS.build(name)
    pairs = [(r, TRUTH.get(name, "3")) for r in GARBAGE_RESPONSES] + [("3", t) for t in GARBAGE_TRUTHS]
    for response, truth in pairs:
        result = verifier.verify(response, truth)
        assert isinstance(result, VerifyResult), (response, truth)
        assert result.outcome in OUTCOMES and math.isfinite(result.score), (response, truth, result)
        assert result.outcome == "correct" or result.score == 0.0, "at default settings anything but correct scores 0"


# -- rollout-engine backends ------------------------------------------------------------------------------------


def _backends() -> list[str]:
    from megarl.rollout.backends import BACKENDS

    return BACKENDS.names()


@pytest.mark.parametrize("name", _backends())
def test_rollout_engine_backend_contract(name, tiny_qwen2):
    from megarl.config import build_config
    from megarl.rollout import Completion, RolloutEngine, SamplingParams
    from safetensors.torch import load_file

    from megarl.rollout.backends import BACKENDS
    from megarl.rollout.weight_sync import pack_buckets

    from megarl.arguments import components

    cfg = build_config({"hf_checkpoint": str(tiny_qwen2), "rollout_backend": name, "rollout_device": "cpu"},
                       components())
    ok, why = BACKENDS.get(name).available(cfg)
    if not ok:
        pytest.skip(f"backend {name} cannot run here: {why}")
    engine = BACKENDS.get(name).build(cfg, None)
    assert isinstance(engine, RolloutEngine)
    weights = load_file(str(tiny_qwen2 / "model.safetensors")).items()  # the checkpoint, HF-named
    if not engine.shares_actor_weights:
        engine.load_weight_buckets(pack_buckets(weights, 64 << 10, engine.dtype), version=5)
    assert engine.weight_version == 5 or engine.shares_actor_weights
    engine.release_memory()
    engine.resume_memory()
    prompts = [[5, 17, 33], [12, 7, 2, 9]]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=4, stop_token_ids=(3,), seed=1)
    groups = engine.generate(prompts, params)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups)
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert isinstance(c, Completion) and 1 <= len(c.token_ids) <= 4 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == 3 else "length")
            assert 3 not in c.token_ids[:-1] and all(lp <= 0.0 for lp in c.logprobs)
            assert c.weight_version == engine.weight_version
            rescored = engine.score([prompt + c.token_ids], [len(prompt)], temperature=1.0)[0]
            assert rescored == pytest.approx(c.logprobs, abs=1e-4), "generate's log-probs are score's"
    assert engine.generate([], params) == []
    engine.shutdown()


def test_every_engine_declares_the_whole_protocol():
    """Members the loop and the weight sync use exist on every engine class, the GPU-only ones included."""
    from megarl.mcore.inference_engine import MegatronEngine
    from megarl.rollout import RolloutEngine
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.sglang_engine import SGLangEngine, SGLangServers

    methods = ("generate", "score", "update_weights", "load_weight_buckets", "release_memory", "resume_memory",
               "shutdown")
    declared = {n for n, v in vars(RolloutEngine).items() if callable(v) and not n.startswith("_")}
    assert declared == set(methods)
    assert set(RolloutEngine.__annotations__) == {"weight_version", "dtype", "shares_actor_weights"}
    for cls in (BuiltinEngine, SGLangEngine, SGLangServers, MegatronEngine):
        assert all(callable(getattr(cls, m, None)) for m in methods), cls
        assert isinstance(cls.shares_actor_weights, bool), cls
    assert isinstance(SGLangServers(["h:1"]), RolloutEngine) and isinstance(SGLangEngine(object()), RolloutEngine)
    assert MegatronEngine.shares_actor_weights and not BuiltinEngine.shares_actor_weights
