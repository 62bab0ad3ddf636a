"""Registries: one behaviour for every plugin slot, and the config's choices agree with what is registered."""

import typing

import pytest

from megarl.algorithms import advantages, losses
from megarl.config import AlgorithmConfig
from megarl.registry import Registry
from megarl.verifiers import get_verifier, verifier_names


def test_registry_register_get_and_errors():
    reg: Registry[int] = Registry("widget")
    reg.register("b")(2)
    reg.register("a")(1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg and "c" not in reg
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(3)
    with pytest.raises(ValueError, match=r"unknown widget 'z'; valid names: a, b"):
        reg.get("z")


def _choices(field: str) -> list[str]:
    return sorted(typing.get_args(typing.get_type_hints(AlgorithmConfig)[field]))


@pytest.mark.parametrize("field, registry", [
    ("advantage_estimator", advantages._ADVANTAGES),
    ("policy_loss", losses._POLICY_LOSSES),
    ("kl_estimator", losses._KL_ESTIMATORS),
])
def test_config_choices_match_registries(field, registry):
    # The flag's allowed values are checked before any work starts; each must resolve in the registry.
    assert _choices(field) == registry.names()


def test_verifier_registry():
    assert "arithmetic" in verifier_names()
    assert get_verifier("arithmetic").verify("19", "19").outcome == "correct"
    with pytest.raises(ValueError, match="unknown verifier 'nope'; valid names: .*arithmetic"):
        get_verifier("nope")
