"""The settings that were sections' fields of megarl's own until they moved to the options of the component they
belong to (a backend's, an estimator's, a correction's, a loss's): the one place the config names them, so that code
reading the old attribute learns where the setting went. Their flags, and saved config.json files, are unchanged
(`megarl.config.saved` reads a setting by its name). Goes in megarl 0.3, with the other shims.
"""

from __future__ import annotations

# Settings that were megarl's own until they moved to the component they belong to: their flags are
# unchanged; code that read them from a section gets an AttributeError naming the new place.
MOVED: dict[str, dict[str, str]] = {
    "rollout": {**dict.fromkeys(("rollout_device", "rollout_threads"), "rollout_backend.builtin"),
                **dict.fromkeys(("sglang_mem_fraction", "sglang_tp_size", "weight_sync_port"),
                                "rollout_backend.sglang")},
    "algorithm": {"clip_ratio_c": "policy_loss.dual_clip",
                  **dict.fromkeys(("tis_cap", "decoupled_is_cap"), "off_policy_correction.tis"),
                  "seq_tis_cap": "off_policy_correction.seq_tis",
                  **dict.fromkeys(("mis_level", "mis_low", "mis_high"), "off_policy_correction.mis"),
                  **dict.fromkeys(("geo_rs_low", "geo_rs_high"), "off_policy_correction.geo_rs"),
                  **dict.fromkeys(("icepop_low", "icepop_high"), "off_policy_correction.icepop"),
                  **dict.fromkeys(("gae_gamma", "gae_lambda", "gae_whiten", "value_clip"), "advantage_estimator.gae")},
}


def moved(section: str, name: str):
    """Raise the AttributeError for `cfg.<section>.<name>`: naming the new place when the setting moved."""
    new = MOVED.get(section, {}).get(name)
    if new is None:
        raise AttributeError(f"{section} settings have no {name!r}")
    raise AttributeError(f"cfg.{section}.{name} moved to its component's options: cfg.components[{new!r}].{name} "
                         f"(the flag --{name.replace('_', '-')} is unchanged)")
