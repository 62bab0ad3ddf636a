"""Qwen3 and Qwen3-MoE on CPU/gloo against `transformers`: logits, HF -> Megatron -> HF, expert parallelism.

Each test is one torchrun whose processes run several layouts in turn (`worker.py` scenarios `layouts` and
`train_layouts`, new process groups per layout), so the many layouts cost one start-up. Layouts are
"model,TP,PP,EP,expert-TP,dispatcher,SP" (expert-TP 0 = TP). The MoE model has 3 layers, the middle one dense
(`mlp_only_layers`), 4 experts of which each token takes 2.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_reference, make_tiny_hf_model, torchrun
from safetensors.torch import load_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/distributed/worker.py"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return (make_tiny_hf_model(root / "tied", "qwen3", tie=True, seed=3),
            make_tiny_hf_model(root / "untied", "qwen3", tie=False, seed=4))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    return (make_tiny_hf_model(root / "topk_norm", "qwen3_moe", seed=5, layers=3, mlp_only_layers=[1]),
            make_tiny_hf_model(root / "no_topk_norm", "qwen3_moe", seed=6, norm_topk_prob=False))


def _run(scenario, models, layouts, tmp_path, nproc, **extra):
    out = tmp_path / scenario
    out.mkdir()
    args = [scenario, "--hf", ",".join(map(str, models)), "--out", out, "--layouts", ";".join(layouts)]
    for k, v in extra.items():
        args += [f"--{k}", v]
    torchrun(nproc, WORKER, *args, timeout=600)
    return [torch.load(out / f"{scenario}-rank{r}.pt", weights_only=False) for r in range(nproc)]


def _check_against_hf(results, models, layouts):
    """Every rank's logits and log-probs equal transformers' within 1e-5; the leader's export is the checkpoint."""
    for name in layouts:
        hf = models[int(name.split(",")[0])]
        ref_logits, ref_logp = hf_reference(hf)
        original = load_file(str(hf / "model.safetensors"))
        for r in results:
            got = r[name]
            if "logits" in got:
                assert (got["logits"] - ref_logits).abs().max() < 1e-5, name
            if got["logprobs"] is not None:
                assert (got["logprobs"] - ref_logp).abs().max() < 1e-5, name
        exported = results[0][name]["exported"]  # rank 0 leads the first replica
        assert set(exported) == set(original), name
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), f"{name}: {key} did not round-trip exactly"


def test_qwen3_logits_and_export_match_hf(qwen3, tmp_path):
    """Tied and untied embeddings, an explicit head_dim (24, not hidden / heads), random q/k norms; TP 2 and PP 2."""
    layouts = ["0,1,1,1,0,allgather,0", "0,2,1,1,0,allgather,0", "1,1,1,1,0,allgather,0",
               "1,2,1,1,0,allgather,0", "1,1,2,1,0,allgather,0"]
    _check_against_hf(_run("layouts", qwen3, layouts, tmp_path, 2), qwen3, layouts)


def test_qwen3_moe_logits_and_export_match_hf(qwen3_moe, tmp_path):
    """(TP, EP, expert-TP) = (1,1,1), (1,2,1), (2,2,1), (2,2,2), both dispatchers; top-k renormalised (model 0,
    with a dense layer) or not (model 1). Exports gather experts over expert-TP, then EP: bitwise the checkpoint."""
    layouts = ["0,1,1,1,0,allgather,0", "0,1,1,2,0,allgather,0", "0,2,1,2,1,allgather,0", "0,2,1,2,2,allgather,0",
               "0,1,1,1,0,alltoall,0", "0,1,1,2,0,alltoall,0", "0,2,1,2,1,alltoall,0", "0,2,1,2,2,alltoall,0",
               "1,1,1,2,0,allgather,0", "1,2,1,2,2,alltoall,0"]
    _check_against_hf(_run("layouts", qwen3_moe, layouts, tmp_path, 4), qwen3_moe, layouts)


def test_qwen3_moe_grpo_step_is_the_same_at_every_expert_split(qwen3_moe, tmp_path):
    """One GRPO update of the same global batch at EP 2, EP 1, EP 2 with the alltoall dispatcher and TP 2 x EP 2
    with sequence parallelism: the same loss, gradient norm and weights. The EP 2 actor's checkpoint resumes at
    EP 1 and at TP 2; the built-in engine synced from it scores as the actor does."""
    layouts = ["0,1,1,2,0,allgather,0", "0,1,1,1,0,allgather,0", "0,1,1,2,0,alltoall,0", "0,2,1,2,1,allgather,1"]
    results = _run("train_layouts", qwen3_moe, layouts, tmp_path, 2, ckpt=tmp_path / "ckpt")
    first = results[0]
    _same_update(first, layouts[1], [layouts[0], *layouts[2:]], qwen3_moe[0])
    saved = first[layouts[0]]
    moved = max((saved["continued_update"][k] - saved["exported"][k]).abs().max().item() for k in saved["exported"])
    assert moved > 1e-3, "the second update did not move the weights"
    for name in layouts[1:]:
        assert first[name]["step"] == 1
        for r in results:
            if r[name]["resumed_logprobs"] is not None:
                assert (r[name]["resumed_logprobs"] - saved["saved_logprobs"]).abs().max() < 1e-5, name
        # the optimizer's state came back too: a second update on another batch equals the saving run's
        for key, tensor in saved["continued_update"].items():
            assert (first[name]["resumed_update"][key] - tensor).abs().max() < 1e-5, (name, key)
    _check_sync(saved, qwen3_moe[0])


def test_qwen3_sequence_parallel_update_and_engine_sync(qwen3, tmp_path):
    """Dense Qwen3 (tied embeddings) at TP 2 with sequence parallelism on megarl's local norms: the update equals
    TP 1's, and after a sync the built-in engine scores as the actor does."""
    layouts = ["0,2,1,1,0,allgather,1", "0,1,1,1,0,allgather,0"]
    first = _run("train_layouts", qwen3, layouts, tmp_path, 2)[0]
    _same_update(first, layouts[1], layouts[:1], qwen3[0])
    _check_sync(first[layouts[0]], qwen3[0])


def _same_update(results, reference, others, hf):
    ref = results[reference]
    original = load_file(str(hf / "model.safetensors"))
    moved = {k: (ref["exported"][k] - original[k]).abs().max().item() for k in original}
    assert min(moved.values()) > 1e-3, "some weights did not move: the comparison would be vacuous"
    for name in others:
        got = results[name]
        assert abs(got["loss"] - ref["loss"]) < 1e-5, name
        assert abs(got["grad_norm"] - ref["grad_norm"]) < 1e-5, name
        for key, tensor in ref["exported"].items():
            assert (got["exported"][key] - tensor).abs().max() < 1e-5, (name, key)


def _check_sync(result, hf):
    _, before = hf_reference(hf)
    assert (result["actor_logprobs"] - before).abs().max() > 1e-3, "the update did not move the model"
    assert (result["engine_logprobs"] - result["actor_logprobs"]).abs().max() < 1e-5
