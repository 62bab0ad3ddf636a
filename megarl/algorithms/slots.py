"""The algorithm slots' registries, and the options of the built-in entries that take any.

    ADVANTAGES              advantage estimators       `megarl.algorithms.advantages`, `.gae`
    POLICY_LOSSES           per-token policy losses    `megarl.algorithms.losses`
    KL_ESTIMATORS           KL(actor || reference)     `megarl.algorithms.losses`
    OFF_POLICY_CORRECTIONS  rollout corrections        `megarl.algorithms.corrections`

The entries are tensor code and register themselves when their module is imported (on the first lookup). Their
options are declared here, beside the registries, in pure Python: the command line (`megarl.arguments`) lists every
entry's flags, and each section checks its own values, without importing torch. Each options dataclass is its
entry's section of the run's config (`Registry.section`: "advantage_estimator.gae", "off_policy_correction.tis");
`Registry.kwargs_of(cfg, name)` gives the keyword arguments the entry is called with. A plugin registers its entry
with `options=` on the registration itself (`megarl.registry`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from megarl.errors import ConfigError
from megarl.registry import Registry, option

ADVANTAGES = Registry("advantage estimator", builtins=("megarl.algorithms.advantages", "megarl.algorithms.gae"),
                      options_declared_here=True)
POLICY_LOSSES = Registry("policy loss", builtins=("megarl.algorithms.losses",), options_declared_here=True)
KL_ESTIMATORS = Registry("KL estimator", builtins=("megarl.algorithms.losses",), options_declared_here=True)
OFF_POLICY_CORRECTIONS = Registry("off-policy correction", builtins=("megarl.algorithms.corrections",),
                                  options_declared_here=True)


def _band(flag: str, low: float, high: float) -> None:
    if not 0 <= low < high:
        raise ConfigError(f"--{flag}-low and --{flag}-high must satisfy 0 <= low < high, got {low} and {high}")


# -- advantage estimators --------------------------------------------------------------------------------------------


@dataclass
class GAEOptions:
    """`gae` (PPO with a critic): the discounting of `compute_gae`, and how the critic stage
    (`megarl.stages.critic_update`) whitens the advantages and clips the value loss."""

    gae_gamma: float = option(1.0, "GAE discount over response tokens (--advantage-estimator gae)")
    gae_lambda: float = option(1.0, "GAE lambda: 1 = reward-to-go minus value, 0 = one-step TD (--advantage-estimator "
                               "gae)")
    gae_whiten: bool = option(True, "whiten GAE advantages over the global batch's response tokens")
    value_clip: float = option(0.2, "PPO value clip: the critic's loss uses max of the plain and the clipped error, "
                               "the clipped value staying within this of the rollout-time value")

    def __post_init__(self):
        if not (0 <= self.gae_gamma <= 1 and 0 <= self.gae_lambda <= 1):
            raise ConfigError(f"--gae-gamma and --gae-lambda must be in [0, 1], got {self.gae_gamma}, "
                              f"{self.gae_lambda}")
        if self.value_clip <= 0:
            raise ConfigError(f"--value-clip must be > 0, got {self.value_clip}")

    def kwargs(self, cfg) -> dict:
        """The estimator's inputs (`compute_gae_advantages(gamma=, lam=)`)."""
        return {"gamma": self.gae_gamma, "lam": self.gae_lambda}


ADVANTAGES.declare("gae", GAEOptions)


# -- policy losses ---------------------------------------------------------------------------------------------------


@dataclass
class DualClipOptions:
    clip_ratio_c: float = option(3.0, "dual-clip cap: a negative-advantage token's loss is at most -c * A (c > 1)")

    def __post_init__(self):
        if self.clip_ratio_c <= 1:
            raise ConfigError(f"--clip-ratio-c must be > 1, got {self.clip_ratio_c}")


POLICY_LOSSES.declare("dual_clip", DualClipOptions)


# -- off-policy corrections ------------------------------------------------------------------------------------------


@dataclass
class TISOptions:
    """`tis`, and its older spellings: `--tis-cap C` alone turns it on, and `--off-policy-correction decoupled`
    (`--decoupled-is-cap`) is tis under its former name; both are resolved here, once (`resolve`)."""

    tis_cap: float = option(0.0, "truncated importance sampling against the rollout engine's log-probs: weight cap "
                            "(e.g. 2.0); 0 = off. A cap alone turns on --off-policy-correction tis (the older "
                            "spelling)")
    decoupled_is_cap: float = option(5.0, "the cap of --off-policy-correction decoupled, the former name of tis: "
                                     "becomes --tis-cap (5.0, as AReaL's recipes set behav_imp_weight_cap)")

    def __post_init__(self):
        if self.tis_cap < 0:
            raise ConfigError(f"--tis-cap must be >= 0, got {self.tis_cap}")
        if self.decoupled_is_cap <= 0:
            raise ConfigError(f"--decoupled-is-cap must be > 0, got {self.decoupled_is_cap}")

    def resolve(self, cfg) -> None:
        """The older spellings, resolved here and nowhere else: the loss only ever sees a registered name."""
        a = cfg.algorithm
        if a.off_policy_correction == "none" and self.tis_cap > 0:
            a.off_policy_correction = "tis"  # --tis-cap C alone
        if a.off_policy_correction == "decoupled":  # the same per-token loss as tis (`grpo_token_loss`)
            if self.tis_cap > 0:
                raise ConfigError(f"--tis-cap {self.tis_cap} is the cap of --off-policy-correction tis; decoupled "
                                  "takes --decoupled-is-cap")
            print(f"megarl: note: --off-policy-correction decoupled is now spelled --off-policy-correction tis "
                  f"--tis-cap {self.decoupled_is_cap:g} (the same loss)", file=sys.stderr, flush=True)
            a.off_policy_correction, self.tis_cap = "tis", self.decoupled_is_cap
        if a.off_policy_correction == "tis" and self.tis_cap == 0:
            raise ConfigError("--off-policy-correction tis needs --tis-cap > 0, its weight cap (e.g. 2.0)")

    def kwargs(self, cfg) -> dict:
        return {"cap": self.tis_cap}


@dataclass
class SeqTISOptions:
    seq_tis_cap: float = option(2.0, "--off-policy-correction seq_tis: cap of a sequence's importance weight, the "
                                "product of its token ratios (2.0, verl's seq_is preset)")

    def __post_init__(self):
        if self.seq_tis_cap <= 0:
            raise ConfigError(f"--seq-tis-cap must be > 0, got {self.seq_tis_cap}")

    def kwargs(self, cfg) -> dict:
        return {"cap": self.seq_tis_cap}


@dataclass
class MISOptions:
    mis_level: Literal["token", "sequence"] = option("sequence", "--off-policy-correction mis: drop single tokens or "
                                                     "whole sequences (sequence: TRL's default sequence_mask)")
    mis_low: float = option(0.0, "--off-policy-correction mis: a ratio below this is dropped (0: only the upper side, "
                            "TRL's default; verl's decoupled_seq_is_rs preset drops below 0.5 too)")
    mis_high: float = option(2.0, "--off-policy-correction mis: a ratio above this is dropped")

    def __post_init__(self):
        _band("mis", self.mis_low, self.mis_high)

    def kwargs(self, cfg) -> dict:
        return {"level": self.mis_level, "low": self.mis_low, "high": self.mis_high}


@dataclass
class GeoRSOptions:
    geo_rs_low: float = option(0.999, "--off-policy-correction geo_rs: a sequence whose geometric-mean ratio is below "
                               "this is dropped (verl's decoupled_geo_rs preset: 0.999)")
    geo_rs_high: float = option(1.001, "--off-policy-correction geo_rs: a sequence whose geometric-mean ratio is "
                                "above this is dropped (verl's decoupled_geo_rs preset: 1.001)")

    def __post_init__(self):
        _band("geo-rs", self.geo_rs_low, self.geo_rs_high)

    def kwargs(self, cfg) -> dict:
        return {"low": self.geo_rs_low, "high": self.geo_rs_high}


@dataclass
class IcePopOptions:
    icepop_low: float = option(0.5, "--off-policy-correction icepop: a token whose ratio is below this is dropped "
                               "(IcePop's alpha, 0.5)")
    icepop_high: float = option(5.0, "--off-policy-correction icepop: a token whose ratio is above this is dropped "
                                "(IcePop's beta, 5)")

    def __post_init__(self):
        _band("icepop", self.icepop_low, self.icepop_high)

    def kwargs(self, cfg) -> dict:
        return {"low": self.icepop_low, "high": self.icepop_high}


OFF_POLICY_CORRECTIONS.declare("tis", TISOptions)
OFF_POLICY_CORRECTIONS.declare("seq_tis", SeqTISOptions)
OFF_POLICY_CORRECTIONS.declare("mis", MISOptions)
OFF_POLICY_CORRECTIONS.declare("geo_rs", GeoRSOptions)
OFF_POLICY_CORRECTIONS.declare("icepop", IcePopOptions)
