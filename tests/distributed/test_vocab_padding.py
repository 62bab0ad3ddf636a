"""A vocabulary that TP does not divide (97 rows at TP 3), padded as Megatron pads it, against `transformers`; and
the offline converter (`megarl-convert-checkpoint`) of the padded TP 3 checkpoint back to an HF directory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import REPO, env, make_tiny_hf_model, torchrun
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TP = 3


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory):
    """A tiny Qwen2 with 97 tokens, 6 heads, 3 KV heads, run at TP 3 (`worker.scenario_padded_vocab`)."""
    root = tmp_path_factory.mktemp("padded")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab=97, hidden_size=96, intermediate_size=192,
                            num_attention_heads=6, num_key_value_heads=3)
    out, ckpt = root / "out", root / "ckpt"
    out.mkdir()
    torchrun(TP, "tests/distributed/worker.py", "padded_vocab", "--hf", hf, "--out", out, "--tp", TP, "--ckpt", ckpt,
             timeout=400)
    ranks = [torch.load(out / f"padded_vocab-rank{r}.pt", weights_only=False) for r in range(TP)]
    return {"hf": hf, "ckpt": ckpt, "ranks": ranks, "root": root}


def _hf_logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    with torch.no_grad():
        return model(tokens).logits


def _logprobs(logits, tokens, temperature=0.7):
    return torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _tokens():  # worker._fixed_tokens
    return torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(1234))


def test_padded_vocabulary_matches_transformers_at_tp3(padded_run):
    r0 = padded_run["ranks"][0]
    assert r0["rows"] == 108 and r0["local_rows"] == 36, "97 rows padded to a multiple of 4 x TP 3, 36 per rank"
    assert r0["padding_logits"].shape[-1] == 108 - 97 and r0["padding_logits"].abs().max() == 0, \
        "the padding rows are loaded as zeros (and masked in the log-probs, below)"
    logits = _hf_logits(padded_run["hf"], _tokens())
    assert (r0["logprobs"] - _logprobs(logits, _tokens())).abs().max() < 1e-4
    reference = torch.distributions.Categorical(logits=logits[:, :-1] / 0.7).entropy()
    for r in padded_run["ranks"]:  # every TP rank holds the whole-vocabulary entropy
        assert (r["entropy"] - reference).abs().max() < 1e-4


def test_padded_vocabulary_exports_exactly(padded_run):
    original = load_file(str(padded_run["hf"] / "model.safetensors"))
    exported = padded_run["ranks"][0]["exported"]
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name  # the padding rows are dropped, nothing else changes
    assert all(not r["exported"] for r in padded_run["ranks"][1:])


def test_offline_converter_writes_what_transformers_loads(padded_run):
    """The TP 3 checkpoint of the updated actor, converted in one process, is the actor's own export, and
    transformers' logits on it give the actor's log-probs."""
    out = padded_run["root"] / "converted"
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.convert_checkpoint", "--load",
                           str(padded_run["ckpt"]), "--out", str(out)], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = padded_run["ranks"][0]["exported_after"]
    converted = load_file(str(out / "model.safetensors"))
    original = load_file(str(padded_run["hf"] / "model.safetensors"))
    assert set(converted) == set(after)
    assert max((after[k] - original[k]).abs().max().item() for k in original) > 1e-3, "the update moved nothing"
    for name, tensor in after.items():
        assert torch.equal(converted[name], tensor), name
    logp = _logprobs(_hf_logits(out, _tokens()), _tokens())
    assert (logp - padded_run["ranks"][0]["logprobs_after"]).abs().max() < 1e-4

    again = subprocess.run([sys.executable, "-m", "megarl.cli.convert_checkpoint", "--load",
                            str(padded_run["ckpt"]), "--ckpt-step", "7", "--out", str(out) + "_again"], cwd=REPO,
                           env=env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "--ckpt-step 7: no iter_0000007 under --load" in again.stderr and "complete steps there: 1" in again.stderr
