"""`megarl-convert-checkpoint` both ways for LoRA, against `peft` (the independent reference): a PEFT adapter
directory made by `peft` itself -> a megarl adapters checkpoint (`--from-peft`) -> a PEFT directory again (`--load
... --to peft`, what `--save-peft` writes): the same tensors bit for bit, and `peft` loads the result with the
logits of the original adapters. A run starts from the converted checkpoint with `--lora-checkpoint`, and `--load`
refuses it with the flag to use. In process, one rank."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from lora_checks import adapter_values, batch

from megarl.cli.convert_checkpoint import main as convert

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft", reason="peft (the dev extra) is the independent reference for LoRA")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # a fused layer with one part left out (k, gate)


@pytest.fixture()
def master(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))


def _peft_model(hf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf).float().eval()


def test_peft_directory_to_megarl_checkpoint_and_back_is_bitwise(tiny_qwen2, tmp_path, master):
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    pm = get_peft_model(_peft_model(tiny_qwen2), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                             lora_dropout=0.0))
    names = {n.replace(".default.", "."): tuple(p.shape) for n, p in pm.named_parameters() if p.requires_grad}
    values = adapter_values(names)  # B non-zero: a fresh adapter would change nothing
    assert set_peft_model_state_dict(pm, values).unexpected_keys == []
    pm.save_pretrained(tmp_path / "peft")
    tokens, _ = batch(pm.config.vocab_size)
    with torch.no_grad():
        logits = pm(tokens).logits

    assert convert(["--from-peft", str(tmp_path / "peft"), "--out", str(tmp_path / "ckpt")]) == 0
    assert convert(["--load", str(tmp_path / "ckpt"), "--to", "peft", "--out", str(tmp_path / "again")]) == 0

    before = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    after = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert before.keys() == after.keys() == values.keys()
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    cfg0, cfg1 = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("peft", "again"))
    assert {k: cfg1[k] for k in ("r", "lora_alpha", "lora_dropout")} == {k: cfg0[k] for k in ("r", "lora_alpha",
                                                                                             "lora_dropout")}
    assert sorted(cfg1["target_modules"]) == sorted(cfg0["target_modules"])
    loaded = PeftModel.from_pretrained(_peft_model(tiny_qwen2), tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, logits)

    # A run starts from the converted checkpoint (--lora-checkpoint); --load, which resumes a run, refuses it.
    from megarl.config import ConfigError, build_config
    from megarl.data import PromptSampler
    from megarl.mcore import checkpoint, lora, parallel
    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.trainer.checkpoints import resume as _resume

    cfg = build_config({"hf_checkpoint": str(tiny_qwen2), "lora_rank": 4, "lora_alpha": 8.0,
                        "lora_target_modules": ",".join(TARGETS), "lora_checkpoint": str(tmp_path / "ckpt")})
    parallel.init_distributed(tp=1, pp=1, timeout_s=60, seed=0)
    try:
        actor = MegatronPolicy(ModelShape.from_pretrained(tiny_qwen2), tp=1, pp=1, trainable=True,
                               lora=lora.LoRAOptions.from_config(cfg.model))
        assert _resume(cfg, None, actor, PromptSampler(4, seed=0), lambda *a: None) == (0, {})
        started = lora.peft_tensors(actor.model)
        assert started.keys() == values.keys() and all(torch.equal(started[n], t) for n, t in values.items())
        with pytest.raises(ConfigError, match="start a run from it with --lora-checkpoint, not --load"):
            checkpoint.load(checkpoint.find_latest(tmp_path / "ckpt"), actor)
    finally:
        parallel.destroy()


def test_from_peft_refuses_what_megarl_cannot_hold(tiny_qwen2, tmp_path, capsys):
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(b"")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True,
              "base_model_name_or_path": str(tiny_qwen2)}
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(config))
    assert convert(["--from-peft", str(tmp_path / "dora"), "--out", str(tmp_path / "out")]) == 2
    assert "adapter_config.json has use_dora True; megarl's LoRA takes False" in capsys.readouterr().err
    config.update(use_dora=False, target_modules=["lm_head"])
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(config))
    assert convert(["--from-peft", str(tmp_path / "dora"), "--out", str(tmp_path / "out")]) == 2
    assert "target_modules ['lm_head']" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
