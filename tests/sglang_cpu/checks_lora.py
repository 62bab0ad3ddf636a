"""LoRA adapter sync (`--lora-weight-sync adapter`) against SGLang 0.5.23's CPU engine: launched with LoRA
support (`lora_rank`, `lora_targets`; SGLang's `torch_native` LoRA backend, its only one without GPU kernels), the
base weights pushed in buckets, then each version's PEFT-named adapters loaded (`load_lora_adapter`) and named in
every request. The reference: transformers with the adapters merged into its weights (W + alpha/r B A)."""

import torch

from megarl.rollout import weight_sync
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangEngine

STATE: dict = {}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8


def check_launch(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    STATE["engine"] = SGLangEngine.launch(model_dir, device="cpu", dtype="float32", seed=None, mem_fraction=0.05,
                                          max_running_requests=8, lora_rank=RANK, lora_targets=TARGETS,
                                          lora_backend="torch_native")
    STATE["base"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    STATE["model_dir"] = model_dir
    return {}


def _adapters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in STATE["base"].named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in TARGETS and isinstance(module, torch.nn.Linear):
            prefix = f"base_model.model.{name}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=g) * 0.1
            out[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=g) * 0.1
    return out


@torch.no_grad()
def _merged_logp(tokens: list[int], adapters: dict[str, torch.Tensor]) -> torch.Tensor:
    import copy

    model = copy.deepcopy(STATE["base"])
    for name, module in model.named_modules():
        a = adapters.get(f"base_model.model.{name}.lora_A.weight")
        if a is not None:
            module.weight += (ALPHA / RANK) * adapters[f"base_model.model.{name}.lora_B.weight"] @ a
    logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def check_adapter_sync(versions: int = 2) -> dict:
    engine = STATE["engine"]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": STATE["model_dir"],
              "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": TARGETS, "bias": "none",
              "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True}
    weight_sync.push(engine, iter(STATE["base"].state_dict().items()), 1)  # the base, once
    out = []
    for v in range(1, versions + 1):
        adapters = _adapters(v)
        weight_sync.push_adapter(engine, adapters, config, v)
        assert engine.adapter == f"megarl-v{v}" and engine.weight_version == v
        probe = weight_sync.probe_sequence(80, length=24, seed=v)
        engine_logp = torch.tensor(engine.score([probe], [1])[0])
        check = weight_sync.check_probe(_merged_logp(probe, adapters), engine_logp, tolerance=1e-3)
        c = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))[0][0]
        assert c.weight_version == v and len(c.logprobs) == len(c.token_ids)
        out.append({"version": v, **check})
    return {"versions": out}


def close() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()
