"""Registries: one behaviour for every plugin slot, and the config's choices agree with what is registered."""

import pytest

import dataclasses
import sys

from megarl.algorithms.advantages import ADVANTAGES
from megarl.algorithms.corrections import OFF_POLICY_CORRECTIONS
from megarl.algorithms.losses import KL_ESTIMATORS, POLICY_LOSSES
from megarl.arguments import components, parse_args, valid_names
from megarl.config import ConfigError, flag_specs
from megarl.registry import Registry, option
from megarl.reward.models import REWARD_MODELS
from megarl.rollout.backends import BACKENDS
from megarl.rollout.functions import ROLLOUTS
from megarl.verifiers import VERIFIERS


def test_registry_register_get_and_errors():
    reg: Registry[int] = Registry("widget")
    reg.register("b")(2)
    reg.register("a")(1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg and "c" not in reg
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(3)
    with pytest.raises(ValueError, match=r"unknown widget 'z'; valid names: a, b"):
        reg.get("z")


def test_a_registry_imports_its_builtins_on_first_lookup_only(tmp_path, monkeypatch):
    (tmp_path / "widget_builtin_mod.py").write_text(
        "from widget_registry_mod import WIDGETS\nWIDGETS.add('builtin', 7)\n")
    (tmp_path / "widget_registry_mod.py").write_text(
        "from megarl.registry import Registry\nWIDGETS = Registry('widget', builtins=('widget_builtin_mod',))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from widget_registry_mod import WIDGETS

    assert "widget_builtin_mod" not in sys.modules  # importing the registry registers nothing yet
    assert WIDGETS.get("builtin") == 7 and WIDGETS.names() == ["builtin"] and "builtin" in WIDGETS
    assert "widget_builtin_mod" in sys.modules


def test_an_entrys_options_are_a_dataclass_and_give_its_keyword_arguments():
    @dataclasses.dataclass
    class Opts:
        widget_size: int = option(3, "how big")

    reg: Registry = Registry("widget")
    reg.register("w", options=Opts)(dict)
    assert reg.options() == {"w": Opts} and reg.section("w") == "widget.w"
    cfg = type("Cfg", (), {"components": {"widget.w": Opts(widget_size=5)}})()
    assert reg.kwargs(cfg) == {"w": {"widget_size": 5}}
    assert reg.kwargs(type("Cfg", (), {"components": {}})()) == {"w": {"widget_size": 3}}  # defaults when absent
    with pytest.raises(TypeError, match="options must be a dataclass"):
        reg.register("v", options=int)(dict)


def test_options_declared_beside_a_registry_are_listed_without_importing_its_entries(tmp_path, monkeypatch):
    """The built-ins of a slot whose code imports torch declare their options where the registry lives
    (`megarl.algorithms.slots`, `megarl.rollout.slots`): listing them imports no entry's module, and the entry
    registered later keeps them."""
    (tmp_path / "gadget_builtin_mod.py").write_text("from gadget_registry_mod import GADGETS\nGADGETS.add('g', 1)\n")
    (tmp_path / "gadget_registry_mod.py").write_text(
        "import dataclasses\nfrom megarl.registry import Registry, option\n"
        "GADGETS = Registry('odd-gadget', builtins=('gadget_builtin_mod',), options_declared_here=True)\n"
        "@dataclasses.dataclass\nclass G:\n    gadget_size: int = option(2, 'size')\n"
        "    def kwargs(self, cfg):\n        return {'size': self.gadget_size}\n"
        "GADGETS.declare('g', G)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from gadget_registry_mod import GADGETS, G

    assert GADGETS.options() == {"g": G} and "gadget_builtin_mod" not in sys.modules
    assert GADGETS.section("g") == "odd_gadget.g"
    assert GADGETS.get("g") == 1 and GADGETS.options() == {"g": G}
    cfg = type("Cfg", (), {"components": {"odd_gadget.g": G(gadget_size=5)}})()
    assert GADGETS.settings(cfg, "g").gadget_size == 5 and GADGETS.kwargs_of(cfg, "g") == {"size": 5}
    assert GADGETS.kwargs_of(None, "g") == {"size": 2} and GADGETS.settings(cfg, "nope") is None
    with pytest.raises(ValueError, match="'g' already declares options: G"):
        GADGETS.declare("g", dataclasses.make_dataclass("H", []))


def test_the_command_line_lists_every_components_options_without_torch():
    """The launch scripts parse recipes on a batch host's python: every built-in's options are known there."""
    import subprocess

    from helpers import REPO, env

    code = ("import sys\nsys.modules['torch'] = None\nfrom megarl.arguments import components\n"
            "print(' '.join(sorted(components())))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {"advantage_estimator.gae", "policy_loss.dual_clip", "off_policy_correction.tis",
            "off_policy_correction.icepop", "rollout_backend.sglang", "rollout_backend.builtin",
            "rollout_function.tool_use"} <= set(proc.stdout.split())


def test_the_builtin_components_declare_their_options_and_config_names_none_of_them():
    sections = components()
    assert {"verifier.code", "verifier.math", "reward_model.hf_rm", "reward_model.remote_rm",
            "reward_model.llm_judge"} <= set(sections)
    flags = flag_specs(sections)
    assert flags["--code-reward"].section == "verifier.code"
    assert flags["--judge-url"].section == "reward_model.llm_judge"
    assert "--code-reward" not in flag_specs()  # megarl.config alone knows only its own sections


@pytest.mark.parametrize("flag, registry", [
    ("--advantage-estimator", ADVANTAGES),
    ("--policy-loss", POLICY_LOSSES),
    ("--kl-estimator", KL_ESTIMATORS),
    ("--rollout-backend", BACKENDS),
    ("--rollout-function", ROLLOUTS),
    ("--default-verifier", VERIFIERS),
    ("--off-policy-correction", OFF_POLICY_CORRECTIONS),
])
def test_flags_naming_registry_entries_take_exactly_the_registered_names(flag, registry, monkeypatch):
    spec = flag_specs()[flag]
    # A row's verifier (and so --default-verifier) may be a rule verifier or a reward model.
    names = sorted(registry.names() + REWARD_MODELS.names()) if flag == "--default-verifier" else registry.names()
    assert valid_names(spec) == names
    with pytest.raises(ConfigError, match=f"command line: {flag} 'no_such_entry' is not registered; choose one of: "
                                          + ", ".join(names)):
        parse_args([flag, "no_such_entry"])
    # A name registered later (a plugin's) is as valid as the built-in ones.
    monkeypatch.setitem(registry._items, "no_such_entry", registry.get(registry.names()[0]))
    assert getattr(getattr(parse_args([flag, "no_such_entry"]), spec.section), spec.name) == "no_such_entry"


def test_verifier_registry():
    assert "arithmetic" in VERIFIERS.names()
    assert VERIFIERS.build("arithmetic").verify("19", "19").outcome == "correct"
    with pytest.raises(ValueError, match="unknown verifier 'nope'; valid names: .*arithmetic"):
        VERIFIERS.build("nope")
