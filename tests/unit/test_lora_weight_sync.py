"""--lora-weight-sync adapter: what SGLang is sent (the frozen base once, then the adapters in PEFT form) against
`peft`'s own adapter state dict and config on the `transformers` model, the engine's calls in a colocation cycle
(recording fakes of `sglang.Engine`), and the flag's configuration rules. SGLang's own signatures and parsers judge
the same calls in tests/contracts/test_sglang_*_contract.py."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from lora_checks import ALL, ALPHA, RANK, adapter_values

from megarl.config import build_config, parse_config
from megarl.errors import ConfigError
from megarl.mcore.parallel import ParallelInfo
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangEngine
from megarl.stages import colocation

ONE_RANK = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
ADAPTER = {"rollout_backend": "sglang", "lora_rank": RANK, "lora_alpha": ALPHA, "lora_weight_sync": "adapter"}


class LoRAEngine:
    """The slice of `sglang.Engine` (launched with enable_lora) that the adapter sync calls, recording each call.
    `score_as(adapter)`: the log-probs it scores with the adapter a request names (None: the base alone)."""

    def __init__(self, log, score_as=None):
        self.log, self.score_as = log, score_as
        self.base: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, tuple[dict, dict]] = {}
        self.requests: list[dict] = []

    def release_memory_occupation(self, tags=None):
        self.log.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", tuple(tags)))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.log.append("update")
        self.base.update({n: t.clone() for n, t in named_tensors[0].tensors()})  # serialize: the bucket itself
        return True, "Success"

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        self.log.append(("load", lora_name))
        if lora_name in self.adapters:
            return {"success": False, "error_message": f"LoRA adapter {lora_name} is already loaded"}
        self.adapters[lora_name] = ({n: t.clone() for n, t in tensors.items()}, dict(config_dict))
        return {"success": True, "error_message": None}

    def unload_lora_adapter(self, lora_name):
        self.log.append(("unload", lora_name))
        del self.adapters[lora_name]
        return {"success": True}

    def flush_cache(self):
        self.log.append("flush_cache")

    def generate(self, input_ids, sampling_params, return_logprob=False, logprob_start_len=None, lora_path=None,
                 **_):
        names = lora_path or [None] * len(input_ids)
        assert all(n is None or n in self.adapters for n in names), f"{names}: not loaded"
        self.requests.append({"lora_path": lora_path, "score": logprob_start_len == 0})
        self.log.append("score" if logprob_start_len == 0 else "generate")
        out = []
        for ids, name in zip(input_ids, names):
            logp = self.score_as(name) if self.score_as else -1.0
            meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.5, 3, None)],
                    "input_token_logprobs": [(None, ids[0], None)] + [(logp, t, None) for t in ids[1:]]}
            out.append({"output_ids": [3], "meta_info": meta})
        return out


class FakeLoRAActor:
    """What the sync needs of a LoRA `MegatronPolicy`: the export (merged or the base alone), the adapters in PEFT
    form, and log-probs for the probe (-2 with its adapters, which the engine gives only with the adapter on)."""

    shape = type("Shape", (), {"vocab_size": 50})()

    def __init__(self, log):
        self.log = log
        self.step = 0

    def iter_hf(self, every_tp_rank=False, merge_adapters=True):
        self.log.append(("export", merge_adapters))
        yield "model.layers.0.self_attn.q_proj.weight", torch.full((4, 4), 1.0 if merge_adapters else 0.0)

    def peft_adapters(self):
        self.log.append("peft_adapters")
        a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        return {a: torch.full((RANK, 4), float(self.step))}, {"r": RANK, "lora_alpha": ALPHA,
                                                              "target_modules": ["q_proj"]}

    def logprobs(self, tokens, micro_batch_size, temperature=1.0):
        return torch.full((1, tokens.shape[1] - 1), -2.0)

    def onload(self):
        pass


def test_base_once_then_only_adapters_each_named_by_the_requests_after_it():
    log = []
    engine = SGLangEngine(LoRAEngine(log), serialize=lambda bucket, tp: [bucket] * tp)
    actor = FakeLoRAActor(log)
    sync = colocation.WeightSync(actor, engine, build_config(ADAPTER).rollout, ONE_RANK)
    engine.release_memory()  # as at launch (`setup.launch_engine_first`): the weights go too
    sync(version=0)
    assert log[1:] == [("resume", ("weights",)), ("export", False), "update", "peft_adapters",
                       ("load", "megarl-v0")], "the base, not merged, then the adapters"
    assert torch.equal(engine.engine.base["model.layers.0.self_attn.q_proj.weight"], torch.zeros(4, 4))
    for step in (1, 2):
        colocation.enter_training(actor, engine)  # the base stays: it is never sent again
        assert log[-1] == ("release", ("kv_cache", "cuda_graph")), log[-1]
        log.clear()
        actor.step = step
        metrics = sync(version=step)
        assert log == ["peft_adapters", ("load", f"megarl-v{step}"), ("unload", f"megarl-v{step - 1}")]
        assert metrics["sync_bytes"] == RANK * 4 * 4 and engine.weight_version == step
        assert list(engine.engine.adapters) == [f"megarl-v{step}"]
        tensors, _ = engine.engine.adapters[f"megarl-v{step}"]
        assert all(torch.equal(t, torch.full((RANK, 4), float(step))) for t in tensors.values())
        colocation.enter_rollout(actor, engine, build_config({}).training)
        groups = engine.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=1))
        assert [len(g) for g in groups] == [2, 2]
        assert engine.engine.requests[-1]["lora_path"] == [f"megarl-v{step}"] * 4, "every request names it"
        engine.score([[1, 2, 3]], [1])
        assert engine.engine.requests[-1]["lora_path"] == [f"megarl-v{step}"]


def test_verify_weight_sync_scores_the_probe_with_the_new_adapter_applied():
    """The probe holds only when the engine applies the adapter just loaded: the fake scores -2 (the actor's
    log-probs) under the newest adapter, -1 under the base or an older one."""
    log = []
    fake = LoRAEngine(log)
    fake.score_as = lambda name: -2.0 if name == max(fake.adapters, default=None) else -1.0
    engine = SGLangEngine(fake, serialize=lambda bucket, tp: [bucket] * tp)
    cfg = build_config({**ADAPTER, "verify_weight_sync": True, "verify_sync_tolerance": 1e-6})
    actor = FakeLoRAActor(log)
    sync = colocation.WeightSync(actor, engine, cfg.rollout, ONE_RANK)
    sync(version=1)
    probe = colocation.enter_rollout(actor, engine, cfg.training, sync)
    assert probe["sync_probe_absdiff_max"] == 0.0 and probe["sync_probe_version"] == 1
    assert fake.requests[-1] == {"lora_path": ["megarl-v1"], "score": True}
    # Without the adapter on the probe (an engine that kept the base alone), the check fails.
    engine.adapter = None
    sync.pending = colocation.actor_probe(actor, 1, gather=False)
    with pytest.raises(Exception, match="weight sync check failed"):
        colocation.enter_rollout(actor, engine, cfg.training, sync)


def test_a_refused_adapter_load_raises_with_sglangs_message():
    log = []
    engine = SGLangEngine(LoRAEngine(log), serialize=lambda bucket, tp: [bucket] * tp)
    engine.engine.adapters["megarl-v3"] = ({}, {})  # loaded behind megarl's back: SGLang refuses the name
    from megarl.rollout.weight_sync import WeightSyncError

    with pytest.raises(WeightSyncError, match="megarl-v3 is already loaded"):
        engine.load_lora_adapter({}, {}, version=3)
    engine.release_memory()
    with pytest.raises(WeightSyncError, match="push the base weights"):
        engine.load_lora_adapter({}, {}, version=4)


needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft (the dev extra) is the independent reference for LoRA")


@needs_peft
@pytest.mark.slow
def test_the_adapters_and_config_sent_are_peft_s_own(tiny_qwen2, process_group):
    """A LoRA actor with trained-looking adapters (B non-zero) synced in adapter mode: the base SGLang gets is the
    checkpoint's own (not merged), and the adapters and config are what `peft` holds for the same adapters on the
    `transformers` model: its `get_peft_model_state_dict` names and values, its `LoraConfig` fields, its scaling."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.mcore import lora
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape

    shape = ModelShape.from_pretrained(str(tiny_qwen2))
    actor = MegatronPolicy(shape, tp=1, pp=1, trainable=True,
                           lora=lora.LoRAOptions(rank=RANK, alpha=ALPHA, targets=ALL, seed=5))
    actor.load_hf(str(tiny_qwen2))
    values = adapter_values({n: tuple(t.shape) for n, t in lora.peft_tensors(actor.model).items()})
    lora.load_peft_tensors(actor.model, values)
    log = []
    engine = SGLangEngine(LoRAEngine(log), serialize=lambda bucket, tp: [bucket] * tp)
    sync = colocation.WeightSync(actor, engine, build_config(ADAPTER).rollout, ONE_RANK)
    sync(version=0)

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(ALL))
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_qwen2)).float(), config)
    assert set_peft_model_state_dict(pm, values).unexpected_keys == []
    reference = get_peft_model_state_dict(pm)
    sent, sent_config = engine.engine.adapters["megarl-v0"]
    assert sorted(sent) == sorted(reference) and len(sent) == 7 * shape.num_layers * 2
    for name, tensor in reference.items():
        assert torch.equal(sent[name].float(), tensor), name
    expected = config.to_dict()
    for key in ("r", "lora_alpha", "lora_dropout", "peft_type", "use_rslora", "use_dora", "bias", "fan_in_fan_out"):
        assert sent_config.get(key, expected[key]) == expected[key], key
    assert sorted(sent_config["target_modules"]) == sorted(expected["target_modules"])
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert sent_config["lora_alpha"] / sent_config["r"] == q.scaling["default"] == ALPHA / RANK  # SGLang's scaling
    checkpoint = load_file(str(next(tiny_qwen2.glob("*.safetensors"))))
    base = engine.engine.base
    assert set(checkpoint) <= set(base)
    for name, tensor in checkpoint.items():  # the base as it is, the adapters not merged in
        assert torch.equal(base[name], tensor.to(base[name].dtype)), name


@pytest.mark.parametrize("flags, error", [
    ({"lora_weight_sync": "peft"}, "--lora-weight-sync 'peft' is not valid; choose one of: merged, adapter"),
    ({"lora_weight_sync": "adapter", "lora_rank": 8}, "--lora-weight-sync adapter needs --rollout-backend sglang"),
    ({"lora_weight_sync": "adapter", "rollout_backend": "sglang"}, "--lora-weight-sync adapter needs --lora-rank > 0"),
    ({**ADAPTER, "lora_target_modules": "q_proj,experts"}, "SGLang 0.5.23 loads PEFT target_modules"),
    ({**ADAPTER, "rollout_servers": "h:1", "async_staleness": 1}, "--lora-weight-sync adapter with --async-staleness"),
    ({**ADAPTER, "lora_target_modules": "q_proj,o_proj"}, "needs q_proj with v_proj, and gate_proj with up_proj"),
    ({**ADAPTER, "lora_target_modules": "k_proj,v_proj"}, "needs q_proj with v_proj, and gate_proj with up_proj"),
    ({**ADAPTER, "lora_target_modules": "up_proj"}, "needs q_proj with v_proj, and gate_proj with up_proj"),
])
def test_config_errors_name_the_flag(flags, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        build_config(flags)


def test_the_flag_parses_and_defaults_to_merged():
    assert build_config({}).rollout.lora_weight_sync == "merged"
    for targets in ("q_proj,v_proj", "attention", "q_proj,v_proj,gate_proj", "o_proj,down_proj"):
        build_config({**ADAPTER, "lora_target_modules": targets})  # what SGLang 0.5.23 stacks without a gap
    cfg = parse_config(["--rollout-backend", "sglang", "--lora-rank", "8", "--lora-weight-sync", "adapter"])
    assert cfg.rollout.lora_weight_sync == "adapter"
    with pytest.raises(ConfigError, match="--lora-weight-sync 'both' is not valid; choose one of: merged, adapter"):
        parse_config(["--lora-weight-sync", "both"])
