"""Registries: one behaviour for every plugin slot, and the config's choices agree with what is registered."""

import pytest

from megarl.algorithms import advantages, losses
from megarl.config import ConfigError, _valid_names, flag_specs, parse_args
from megarl.registry import Registry
from megarl.rollout import backends, functions
from megarl.verifiers import base, get_verifier, verifier_names
from megarl.verifiers.reward_models import reward_model_names


def test_registry_register_get_and_errors():
    reg: Registry[int] = Registry("widget")
    reg.register("b")(2)
    reg.register("a")(1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg and "c" not in reg
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(3)
    with pytest.raises(ValueError, match=r"unknown widget 'z'; valid names: a, b"):
        reg.get("z")


@pytest.mark.parametrize("flag, registry", [
    ("--advantage-estimator", advantages._ADVANTAGES),
    ("--policy-loss", losses._POLICY_LOSSES),
    ("--kl-estimator", losses._KL_ESTIMATORS),
    ("--rollout-backend", backends._BACKENDS),
    ("--rollout-function", functions._ROLLOUTS),
    ("--default-verifier", base._VERIFIERS),
])
def test_flags_naming_registry_entries_take_exactly_the_registered_names(flag, registry, monkeypatch):
    spec = flag_specs()[flag]
    # A row's verifier (and so --default-verifier) may be a rule verifier or a reward model.
    names = sorted(registry.names() + reward_model_names()) if flag == "--default-verifier" else registry.names()
    assert _valid_names(spec) == names
    with pytest.raises(ConfigError, match=f"command line: {flag} 'no_such_entry' is not registered; choose one of: "
                                          + ", ".join(names)):
        parse_args([flag, "no_such_entry"])
    # A name registered later (a plugin's) is as valid as the built-in ones.
    monkeypatch.setitem(registry._items, "no_such_entry", registry.get(registry.names()[0]))
    assert getattr(getattr(parse_args([flag, "no_such_entry"]), spec.section), spec.name) == "no_such_entry"


def test_verifier_registry():
    assert "arithmetic" in verifier_names()
    assert get_verifier("arithmetic").verify("19", "19").outcome == "correct"
    with pytest.raises(ValueError, match="unknown verifier 'nope'; valid names: .*arithmetic"):
        get_verifier("nope")
