"""The planner's figures against known facts, and its verdicts on layouts that do and do not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from helpers import REPO, env

from megarl import planner as P
from megarl.cli.plan import main as plan_main, shape_from_bash
from megarl.model_shape import ModelShape

H100 = P.GPUS["h100"]


def shape(name: str) -> ModelShape:
    return shape_from_bash(REPO / "recipes/models" / f"{name}.sh")


# Parameter counts as published on the models' Hugging Face pages (safetensors metadata).
@pytest.mark.parametrize("name,params", [("qwen2.5-math-1.5b", 1_543_714_304), ("qwen2.5-math-7b", 7_615_616_512),
                                         ("qwen2.5-7b", 7_615_616_512), ("llama-3.1-8b", 8_030_261_248),
                                         ("llama-3.1-70b", 70_553_706_496), ("qwen3-8b", 8_190_735_360),
                                         ("qwen3-30b-a3b", 30_532_122_624)])
def test_parameter_counts_of_the_shape_files(name, params):
    assert P.num_params(shape(name)) == params


def test_a_mixture_of_experts_counts_active_parameters_and_splits_experts_over_ep():
    """Qwen3-30B-A3B: 48 layers of 128 experts (3 x 2048 x 768 each), 8 per token. On a GPU at TP 2, EP 8,
    expert-TP 1: half of everything but the experts, and 16 whole experts of each layer."""
    s = shape("qwen3-30b-a3b")
    experts = 48 * 128 * 3 * 2048 * 768
    assert P.num_params(s) - P.active_params(s) == 48 * (128 - 8) * 3 * 2048 * 768
    assert 3.3e9 < P.active_params(s) < 3.4e9  # "A3B"
    assert P.stage_params(s, tp=2, pp=1, ep=8, etp=1) == (P.num_params(s) - experts) / 2 + experts / 8
    r = P.RunSettings(tp=2, pp=1, ep=8, etp=1)
    assert P.expert_bytes_per_gpu(s, r) == 2 * experts / 8
    dense = shape("qwen3-8b")
    assert P.active_params(dense) == P.num_params(dense) and P.expert_bytes_per_gpu(dense, r) == 0
    [mem] = P.memory_plan(s, r, P.Cluster(H100, 12))  # 12 GPUs: TP 2 divides them, expert-TP 1 x EP 8 does not
    assert "12 training GPUs are not a multiple of expert-TP 1 x EP 8 x PP 1" in mem.problems


def test_70b_in_bf16_is_140_gb_of_weights_per_instance():
    assert P.weights_bytes(70e9) == 140e9
    s = shape("llama-3.1-70b")
    per_gpu = P.stage_params(s, tp=8, pp=1) * 2
    assert per_gpu * 8 == pytest.approx(P.weights_bytes(P.num_params(s)))  # TP shards add up to one instance
    assert 140e9 <= P.weights_bytes(P.num_params(s)) < 142e9


def test_adam_with_fp32_states_puts_a_70b_actor_past_560_gb_before_activations():
    params = 70e9
    assert 2 * 4 * params == 560e9  # Adam's fp32 m and v alone
    actor = P.weights_bytes(params) + 4 * params + P.adam_state_bytes(params)  # bf16 weights, fp32 grads, Adam
    assert actor == 18 * params > 560e9
    # The planner's per-GPU components over one TP x PP model replica: the same figure, activations aside.
    s = shape("llama-3.1-70b")
    r = P.RunSettings(tp=8, pp=1, micro_batch_size=1)
    [mem] = P.memory_plan(s, r, P.Cluster(H100, 8))
    train = mem.phases[0].components
    replica = 8 * (train["actor weights"] + train["gradients (fp32)"] + train["optimizer (fp32 main + Adam)"])
    assert replica == pytest.approx(18 * P.num_params(s)) and replica > 560e9
    assert not mem.fits and "GiB > 79.6 GiB" in mem.problems[0]  # ~147 GiB a GPU: flagged


@pytest.mark.parametrize("layers,kv_heads,head_dim,expected", [
    (80, 8, 128, 327_680),   # Llama-3.1-70B: 320 KiB a token
    (28, 2, 128, 28_672),    # Qwen2.5-1.5B
    (32, 32, 128, 524_288),  # Llama-2-7B (no GQA): 512 KiB a token
])
def test_kv_cache_bytes_per_token(layers, kv_heads, head_dim, expected):
    s = ModelShape.from_hf_config({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": 4096,
                                   "num_attention_heads": 32, "num_key_value_heads": kv_heads, "head_dim": head_dim,
                                   "intermediate_size": 11008, "vocab_size": 32000})
    assert P.kv_bytes_per_token(s) == 2 * layers * kv_heads * head_dim * 2 == expected


def test_distributed_optimizer_and_offload_shrink_what_they_should():
    s, c = shape("qwen2.5-math-7b"), P.Cluster(H100, 8)
    base = P.RunSettings(tp=2, micro_batch_size=1)
    opt = lambda r: P.memory_plan(s, r, c)[0].phases[0].components["optimizer (fp32 main + Adam)"]
    assert opt(replace(base, distributed_optimizer=True)) == pytest.approx(opt(base) / 4)  # DP = 8 / 2
    rollout = lambda r: P.memory_plan(s, r, c)[0].phases[-1].components
    off = rollout(replace(base, offload_optimizer=True, offload_params=True))
    assert off["optimizer (fp32 main + Adam)"] == off["gradients (fp32)"] == off["actor weights"] == 0
    assert rollout(base)["optimizer (fp32 main + Adam)"] > 0


def test_recommendations():
    small = P.RunSettings(tp=2, rollout_batch_size=128, max_response_len=4096)
    choice, why, colo, _ = P.recommend(shape("qwen2.5-math-1.5b"), small, P.Cluster(H100, 8))
    assert choice == "colocated" and colo.fits and "every GPU works in both phases" in why
    # Colocated, the engine's reservation on top of the resident actor does not fit; dedicated pools do.
    tight = P.RunSettings(tp=2, micro_batch_size=1, distributed_optimizer=True, engine_mem_fraction=0.7)
    choice, why, colo, dis = P.recommend(shape("qwen2.5-math-7b"), tight, P.Cluster(H100, 16))
    assert choice == "disaggregated" and not colo.fits and dis.fits and "colocated does not fit" in why
    # 70B on one node: nothing fits; the reason names the largest component.
    choice, why, *_ = P.recommend(shape("llama-3.1-70b"), P.RunSettings(tp=8, micro_batch_size=1), P.Cluster(H100, 8))
    assert choice == "neither" and "optimizer" in why


def test_cli_on_a_shape_file_and_on_a_config_json(tmp_path, capsys):
    assert plan_main([str(REPO / "recipes/models/llama-3.1-70b.sh"), "--gpus", "64", "--", "--micro-batch-size",
                      "1"]) == 0
    out = capsys.readouterr().out
    assert "70.55B parameters (131.4 GiB in bf16)" in out and "KV cache 320 KiB/token" in out
    assert "recommendation: colocated" in out
    cfg = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert plan_main(["--model", str(tmp_path), "--gpus", "1", "--mode", "colocated", "--", "--max-response-len",
                      "32"]) == 0
    assert "fits" in capsys.readouterr().out


def test_cli_without_a_shape_says_what_to_give():
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.plan", "--gpus", "8"], capture_output=True,
                          text=True, cwd=REPO, env=env())
    assert proc.returncode == 2 and "no model shape: give --model" in proc.stderr


def test_the_old_command_names_the_new_one_and_still_runs():
    """`python tools/plan.py` (the command before megarl-plan) says where it went, then runs it, same arguments."""
    proc = subprocess.run([sys.executable, "tools/plan.py", "recipes/models/qwen2.5-math-1.5b.sh", "--gpus", "8"],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == ("note: tools/plan.py is now megarl-plan (python -m megarl.cli.plan); "
                                           "running it")
    assert "recommendation: colocated" in proc.stdout



def test_the_old_module_still_imports_the_planners_names():
    """`megarl.plan` (the planner's home before `megarl.planner`) re-exports it until megarl 0.3."""
    from megarl import plan as old

    assert old.RunSettings is P.RunSettings and old.plan is P.plan and old.logprob_head_bytes is P.logprob_head_bytes


ONE_GPU = ["--tensor-model-parallel-size", "1", "--no-sequence-parallel"]


@pytest.mark.parametrize("model,gpus,extra,verdict,fix", [
    ("qwen2.5-math-1.5b", 1, [*ONE_GPU, "--micro-batch-size", "8"], "recommendation: neither", "--micro-batch-size 1"),
    ("qwen2.5-math-1.5b", 1, ONE_GPU, "recommendation: neither", "--logprob-chunk-tokens 1024"),
    ("qwen2.5-math-1.5b", 1, [*ONE_GPU, "--logprob-chunk-tokens", "1024"], "recommendation: colocated", None),
    ("qwen2.5-math-7b", 8, [], "recommendation: colocated", None),
    ("llama-3.1-70b", 64, [], "recommendation: colocated", None),
])
def test_the_r1_math_recipe_on_three_cluster_sizes(monkeypatch, capsys, model, gpus, extra, verdict, fix):
    """Three cluster sizes, with r1_math's batch (128 prompts x 8 samples, responses up to 3072 tokens) on
    H100s. On one GPU, micro-batches of 4 sequences (13k tokens) put the full-logits head at 38 GiB, the training
    phase at 94 GiB: the planner names --logprob-chunk-tokens, which brings the head to 1.8 GiB; with 8 sequences
    only a micro-batch of 1 fits."""
    monkeypatch.setenv("RECIPE_MODEL", model)
    rc = plan_main([str(REPO / "recipes/r1_math.sh"), "--gpus", str(gpus), "--", *extra])
    out = capsys.readouterr().out
    assert verdict in out and rc == (1 if "neither" in verdict else 0)
    if fix:
        assert f"each of these makes colocated fit: {fix}" in out


def test_the_training_phase_counts_the_log_prob_head_as_measured():
    """The head as tools/bench/logprob_memory.py measures it (`logprob_head_bytes`): full logits 20 bytes per
    vocabulary entry per token per TP rank (five fp32 copies), not the 10 the planner counted before issue 29;
    chunked, three [chunk, vocab / TP] fp32 tensors whatever the length."""
    s, c = shape("qwen2.5-math-1.5b"), P.Cluster(H100, 8)
    r = P.RunSettings(tp=2, micro_batch_size=4, prompt_len=256, max_response_len=3072)
    head = lambda r: P.memory_plan(s, r, c)[0].phases[0].components["activations + logits"]
    tokens, local, h = 4 * (256 + 3072), 151_936 / 2, 1536
    full, chunked = head(r), head(replace(r, logprob_chunk_tokens=1024))
    # full: 5 x 4 bytes x tokens x local + the weight's gradient (4 x local x h); chunked: 3 x 4 bytes x chunk x
    # local + two weight-sized tensors (8 x local x h) + the hidden states' gradient (4 x tokens x h)
    assert full - chunked == pytest.approx(20 * tokens * local - 12 * 1024 * local - 4 * local * h - 4 * tokens * h)
    assert full - chunked > 17 * 2**30  # 38 GiB against 1.8


def test_a_tp_that_does_not_divide_the_gpus_is_planned_at_a_lower_one(monkeypatch, capsys):
    """The 7B recipe (TP 4) on 2 GPUs: not "does not fit" for want of GPUs, but planned at TP 2, saying so."""
    monkeypatch.setenv("RECIPE_MODEL", "qwen2.5-math-7b")
    plan_main([str(REPO / "recipes/r1_math.sh"), "--gpus", "2"])
    out = capsys.readouterr().out
    assert "TP 4 x PP 1 x CP 1 needs a multiple of 4 GPUs, not 2: planned at --tensor-model-parallel-size 2" in out
    assert "TP 2 x PP 1;" in out and "not a multiple of TP" not in out.split("== disaggregated")[0]


def test_the_planner_says_what_train_py_would_refuse(monkeypatch, capsys):
    rc = plan_main([str(REPO / "recipes/r1_math.sh"), "--gpus", "8", "--", "--max-response-len", "3584"])
    out = capsys.readouterr().out
    assert rc == 1 and "! train.py would stop: --max-prompt-len 1024 + --max-response-len 3584 = 4608 tokens " \
        "exceed the model's 4096 positions" in out
    plan_main([str(REPO / "recipes/r1_math.sh"), "--gpus", "8"])
    assert "prompt ~256 (at most 1024) + response <= 3072 tokens" in capsys.readouterr().out


def test_the_planner_counts_a_reward_model_once_per_server(tmp_path, capsys):
    """The reward model's parameters, as transformers counts them on a Qwen2ForSequenceClassification, in fp32 per
    reward server, one server per model replica's leader on a node (8 GPUs / TP 2 = 4)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from megarl.planner import GIB

    rm = tmp_path / "rm"
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, num_labels=1)
    Qwen2ForSequenceClassification(cfg).save_pretrained(rm)
    params = sum(p.numel() for p in Qwen2ForSequenceClassification(cfg).parameters())
    assert plan_main([str(REPO / "recipes/models/qwen2.5-7b.sh"), "--gpus", "8", "--", "--tensor-model-parallel-size",
                      "2", "--reward-model", str(rm)]) in (0, 1)
    out = capsys.readouterr().out
    assert f"reward model (--reward-model): {params:,} parameters, {4 * params / GIB:.2f} GiB in fp32 per reward " \
        "server" in out
    assert "4 per node (one per model replica's leader)" in out


def test_asynchronous_step_time_overlaps_rollout_and_training():
    """Disaggregated with --async-staleness: max(rollout, training) + sync, against rollout + training + sync; the
    same phases either way, and colocated never overlaps (the engine and the actor share the GPUs)."""
    s, cluster = shape("qwen2.5-math-7b"), P.Cluster(H100, 16)
    sync = P.plan(s, P.RunSettings(tp=2, mode="disaggregated", rollout_gpus=8), cluster)
    asy = P.plan(s, P.RunSettings(tp=2, mode="disaggregated", rollout_gpus=8, async_staleness=1), cluster)
    t = asy.time
    assert (t.rollout, t.training, t.weight_sync) == (sync.time.rollout, sync.time.training, sync.time.weight_sync)
    assert sync.time.total == pytest.approx(t.rollout + t.training + t.weight_sync)
    assert t.total == pytest.approx(max(t.rollout, t.training) + t.weight_sync) and t.total < sync.time.total
    colo = P.plan(s, P.RunSettings(tp=2, async_staleness=1), cluster)
    assert colo.time.total == pytest.approx(colo.time.synchronous)


def test_the_planner_prints_both_modes_for_a_disaggregated_run(monkeypatch, capsys):
    monkeypatch.setenv("RECIPE_MODEL", "qwen2.5-math-7b")
    plan_main([str(REPO / "recipes/r1_math.sh"), "--gpus", "16"])
    out = capsys.readouterr().out.split("== disaggregated")[1]
    line = next(x for x in out.splitlines() if "asynchronous (--async-staleness >= 1" in x)
    sync_s, async_s = (float(w.strip("s;~")) for w in line.split() if w.startswith("~"))
    assert async_s < sync_s and "(this run)" not in line  # the recipe is synchronous


# -- the weight sync and the async copy ---------------------------------------------------------------------------

SMALL = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 96, "tie_word_embeddings": False}


def _small_params() -> int:
    """Qwen2 with QKV biases, by hand: per layer q (64 x 64 + 64), k and v (64 x 32 + 32 each), o (64 x 64), the
    SwiGLU MLP (3 x 64 x 128) and two norms (2 x 64); the embedding and output layer (96 x 64 each), the final
    norm (64)."""
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    return 2 * layer + 2 * 96 * 64 + 64


@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_the_colocated_weight_sync_phase_by_hand(offload_optimizer):
    """The push on a colocated GPU, one GPU at TP 1, --sync-bucket-mb 1, a reference model: the actor's bf16 weights
    (2P), its optimizer (12P; 0 with --offload-optimizer, offloaded before the push), no gradients (freed before
    the push), the reference (2P), the engine's weights, resumed for the push (2P), three 1 MiB buckets and the
    runtime's 4 GiB; no activations, no KV cache (the engine resumes it after the push)."""
    s = ModelShape.from_hf_config(SMALL)
    p = _small_params()
    assert P.num_params(s) == p
    r = P.RunSettings(kl=True, sync_bucket_mb=1, offload_optimizer=offload_optimizer, max_response_len=64)
    [mem] = P.memory_plan(s, r, P.Cluster(H100, 1))
    assert [ph.name for ph in mem.phases] == ["training (engine released)", "weight sync", "rollout"]
    sync = mem.phases[1].components
    assert sync == {"actor weights": 2 * p, "gradients (fp32)": 0.0,
                    "optimizer (fp32 main + Adam)": 0.0 if offload_optimizer else 12 * p, "reference model": 2 * p,
                    "CUDA context, NCCL, fragmentation": 4 * 2**30, "engine weights": 2 * p,
                    "weight-sync buckets": 3 * 2**20}
    assert mem.phases[1].total == 2 * p + (0 if offload_optimizer else 12 * p) + 2 * p + 2 * p + 3 * 2**20 + 4 * 2**30


def test_a_bucket_is_as_large_as_the_largest_tensor():
    """A tensor larger than --sync-bucket-mb gets a bucket of its own: the embedding, vocabulary x hidden in bf16
    (Qwen2.5-7B: 152,064 x 3,584 x 2 bytes = 1,039.5 MiB, above the default 512)."""
    s = shape("qwen2.5-7b")
    assert P.sync_buckets_bytes(s, P.RunSettings()) == 3 * 152_064 * 3_584 * 2
    assert P.sync_buckets_bytes(s, P.RunSettings(sync_bucket_mb=2048)) == 3 * 2048 * 2**20


def test_the_async_copy_is_counted_in_host_memory_on_the_pusher_by_hand():
    """--async-staleness with servers (disaggregated): each sync's copy of the weights waits for the engine in
    pinned host memory on the pushing rank, the whole model in bf16 (2P), none of it on the GPUs; the training GPUs
    then hold the two buckets the pusher's worker brings back to its GPU while the actor trains (--sync-bucket-mb
    1: 2 MiB), and the push three."""
    s = ModelShape.from_hf_config(SMALL)
    p = _small_params()
    cluster = P.Cluster(H100, 2)
    r = P.RunSettings(mode="disaggregated", rollout_gpus=1, sync_bucket_mb=1, max_response_len=64)
    synchronous, _ = P.memory_plan(s, r, cluster)
    training, rollout = P.memory_plan(s, replace(r, async_staleness=2), cluster)
    assert P.async_copy_bytes(s, replace(r, async_staleness=2)) == 2 * p and P.async_copy_bytes(s, r) == 0
    assert training.host == {"async weight copy (pinned)": 2 * p} and synchronous.host == {} and rollout.host == {}
    assert [ph.name for ph in training.phases] == ["training", "weight sync"]
    grown = training.phases[0].total - synchronous.phases[0].total
    assert grown == training.phases[0].components["weight-sync buckets"] == 2 * 2**20
    assert training.phases[1].components["weight-sync buckets"] == 3 * 2**20
    assert "gradients (fp32)" in training.phases[1].components and training.phases[1].components[
        "gradients (fp32)"] == 4 * p  # servers elsewhere: nothing comes back beside the actor, which keeps them


def test_the_plan_of_a_shipped_recipe_names_its_peak_phase(monkeypatch, capsys):
    """r1_math on 8 H100s: the colocated peak is the rollout (the resident actor state, the engine's weights and its
    KV pool), the disaggregated training GPUs' the training phase; the weight sync is printed beside them. Each
    "peak:" line names the phase whose total is the largest."""
    rc = plan_main([str(REPO / "recipes/r1_math.sh"), "--gpus", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    colocated, disaggregated = out.split("== disaggregated")
    assert "weight sync" in colocated.splitlines()[3] and "weight-sync buckets" in colocated
    peaks = [line.strip() for line in out.splitlines() if line.strip().startswith("peak: ")]
    assert [p.split(",")[0] for p in peaks] == ["peak: rollout", "peak: training", "peak: rollout"]
    totals = next(line for line in colocated.splitlines() if line.strip().startswith("total")).split()[1:4]
    assert peaks[0] == f"peak: rollout, {max(map(float, totals)):.1f} GiB per GPU" and float(totals[2]) == max(
        map(float, totals))


def test_the_plan_prints_the_async_copy_of_the_pushing_rank(monkeypatch, capsys):
    """Qwen2.5-Math-7B with --async-staleness and servers: 7,615,616,512 parameters x 2 bytes = 14.2 GiB of pinned
    host memory on the pushing rank, printed under the training GPUs; a synchronous run prints none."""
    monkeypatch.setenv("RECIPE_MODEL", "qwen2.5-math-7b")
    args = [str(REPO / "recipes/r1_math.sh"), "--gpus", "16", "--mode", "disaggregated", "--", "--rollout-servers",
            "h:1"]
    plan_main(args + ["--async-staleness", "1"])
    line = "host memory of the pushing rank: async weight copy (pinned) 14.2 GiB"
    assert line in capsys.readouterr().out and f"{7_615_616_512 * 2 / 2**30:.1f}" == "14.2"
    plan_main(args)
    assert "host memory of the pushing rank" not in capsys.readouterr().out


def test_the_teacher_is_counted_by_hand():
    """On-policy distillation's teacher (T parameters, at TP 2): T bf16 bytes a GPU (2T / 2) in every phase, and
    one forward (2T FLOPs a token) in the training time; no teacher, no component."""
    s = ModelShape.from_hf_config(SMALL)
    t = 3e9
    base = P.RunSettings(tp=2, max_response_len=64)
    with_teacher = P.RunSettings(tp=2, max_response_len=64, teacher_params=t)
    [plain] = P.memory_plan(s, base, P.Cluster(H100, 2))
    [mem] = P.memory_plan(s, with_teacher, P.Cluster(H100, 2))
    assert all("teacher model" not in ph.components for ph in plain.phases)
    for ph, ph0 in zip(mem.phases, plain.phases):
        assert ph.components["teacher model"] == 2 * t / 2
        assert ph.total == ph0.total + t


def test_offload_frozen_counts_the_reference_only_in_its_log_prob_phase_by_hand():
    """--offload-frozen: the reference (2P of bf16 weights) is on the GPU for its log-probs only, a phase of its own
    holding the actor's resident state, the reference, one layer's activations of a micro-batch and the log-prob
    head; the training, weight sync and rollout phases count it as 0, and nothing else changes."""
    s = ModelShape.from_hf_config(SMALL)
    p = _small_params()
    r = P.RunSettings(kl=True, sync_bucket_mb=1, max_response_len=64)
    [kept] = P.memory_plan(s, r, P.Cluster(H100, 1))
    [freed] = P.memory_plan(s, replace(r, offload_frozen=True), P.Cluster(H100, 1))
    assert [ph.name for ph in freed.phases] == ["log-probs (frozen models on)", "training (engine released)",
                                                "weight sync", "rollout"]
    logp, *rest = freed.phases
    for before, after in zip(kept.phases, rest):
        assert after.components["reference model"] == 0.0
        assert {k: v for k, v in after.components.items() if k != "reference model"} == \
            {k: v for k, v in before.components.items() if k != "reference model"}, after.name
        assert before.total - after.total == 2 * p
    tokens = r.micro_batch_size * (r.prompt_len + r.max_response_len)
    layer = P.activation_bytes_per_token_layer(s) * tokens  # TP 1: every term whole
    head = P.logprob_head_bytes(tokens, s.vocab_size, s.hidden_size, tp=1, chunk_tokens=0)
    train = kept.phases[0].components
    assert logp.components == {"actor weights": train["actor weights"], "gradients (fp32)": 4 * p,
                               "optimizer (fp32 main + Adam)": 12 * p, "reference model": 2 * p,
                               "CUDA context, NCCL, fragmentation": 4 * 2**30,
                               "forward activations + logits": pytest.approx(layer + head)}


def test_moonlight_shape_counts_what_transformers_builds_and_caches_the_mla_latent():
    """Moonlight-16B-A3B (DeepSeek-V3): the planner's parameter count equals transformers' own model of the shape
    file's config (built on the meta device); ~3B active; SGLang's MLA cache holds one latent of kv_lora_rank +
    qk_rope_head_dim per token and layer, on every engine TP rank."""
    import torch
    import transformers

    from megarl.cli.plan import _SHAPE_DUMP, _value

    proc = subprocess.run(["bash", "-c", _SHAPE_DUMP, "plan", str(REPO / "recipes/models/moonlight-16b-a3b.sh")],
                          capture_output=True, text=True, check=True)
    words = proc.stdout.split("\0")[:-1]
    cfg = {k: _value(v) for k, v in zip(words[::2], words[1::2])}
    cfg.pop("model_type")
    rope_theta = cfg.pop("rope_theta")
    config = transformers.DeepseekV3Config(**cfg, q_lora_rank=None,
                                           rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    s = shape("moonlight-16b-a3b")
    assert P.num_params(s) == sum(p.numel() for p in model.parameters())
    assert 15.9e9 < P.num_params(s) < 16.0e9 and 2.8e9 < P.active_params(s) < 3.0e9
    assert P.kv_bytes_per_token(s) == 27 * (512 + 64) * 2
