"""Components written before the capability classes set their optional abilities as bare attributes, which megarl
probed by name. It reads them only from the classes now, so such a plugin is refused, naming the base class to add,
instead of losing the ability in silence (`megarl.registry.refuse_bare_capabilities`)."""

from __future__ import annotations

import pytest

from megarl.reward.functions import RewardFunction, as_reward_function
from megarl.rollout.base import EngineCapabilities, as_engine
from megarl.rollout.functions import Rollout, as_rollout, register_rollout
from megarl.verifiers import VERIFIERS, register_verifier


class OldEngine:  # the engine protocol, and a capability megarl 0.1.0 probed for
    shares_actor_weights, dtype, weight_version = False, None, 0
    reports_finished_rows = True


class PlainEngine:
    shares_actor_weights, dtype, weight_version = False, None, 0


def test_an_engine_with_a_bare_capability_is_refused_naming_the_base():
    with pytest.raises(TypeError, match=r"OldEngine defines reports_finished_rows.*megarl.rollout.base.EngineCap"):
        as_engine(OldEngine())
    wrapped = as_engine(PlainEngine())  # a protocol-only engine keeps working, with the defaults
    assert isinstance(wrapped, EngineCapabilities) and wrapped.reports_finished_rows is False


def test_a_rollout_function_with_an_attached_configure_is_refused():
    def old_style(engine, prompts, params, reward, tokenizer):
        return []

    old_style.configure = lambda cfg: old_style  # how tool_use declared it in megarl 0.1.0
    with pytest.raises(TypeError, match=r"defines configure.*megarl.rollout.functions.Rollout"):
        as_rollout(old_style)
    with pytest.raises(TypeError, match="rollout function 'old_style_test'"):
        register_rollout("old_style_test")(old_style)

    def plain(engine, prompts, params, reward, tokenizer):
        return []

    assert isinstance(as_rollout(plain), Rollout)


def test_a_reward_function_and_a_verifier_with_bare_capabilities_are_refused():
    class OldReward:
        restarts = 0
        model_seconds = 1.5

        def __call__(self, samples, records):
            return []

    with pytest.raises(TypeError, match=r"OldReward defines model_seconds.*RewardFunction"):
        as_reward_function(OldReward())

    class OldVerifier:
        budget_s = 2.0

        def verify(self, response, ground_truth):
            return None

    with pytest.raises(TypeError, match=r"verifier 'old_budget_test': .*OldVerifier defines budget_s"):
        register_verifier("old_budget_test")(OldVerifier)
    assert "old_budget_test" not in VERIFIERS
    assert isinstance(as_reward_function(lambda samples, records: []), RewardFunction)
