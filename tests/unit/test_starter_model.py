"""The demo's starter model is bound by its step count: the schedule runs over exactly `--steps` steps, and a
`--minutes` deadline stops the build with a message (writing nothing) instead of shortening it."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO

from tools import make_starter_model as starter


def test_pretrain_takes_its_steps_with_the_schedule_over_them(tmp_path, monkeypatch):
    from megarl.tasks.arithmetic import build_tokenizer, split_problems

    tokenizer = build_tokenizer(tmp_path)
    train, _ = split_problems(seed=0)
    seen = []
    schedule = starter.learning_rate
    monkeypatch.setattr(starter, "learning_rate", lambda step, progress: seen.append((step, progress)) or
                        schedule(step, progress))
    assert starter.pretrain(starter.build_model(tokenizer), tokenizer, train, steps=4, seed=0) == 4
    assert seen == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]  # the cosine's progress is the step's, not the clock's


def test_a_deadline_stops_the_build_and_writes_nothing(tmp_path):
    out = tmp_path / "starter"
    with pytest.raises(SystemExit, match=r"passed --minutes 1e-06 at step \d+ of 50 .*nothing was written"):
        starter.main(["--out", str(out), "--steps", "50", "--minutes", "1e-6"])
    assert list(tmp_path.iterdir()) == [], "no starter and no half-made directory"


def test_the_build_speaks_at_once_and_warns_before_a_deadline_strikes(tmp_path, monkeypatch, capsys):
    """On a clock that moves 1 s per reading (2 s a step): a line at the first step and at least every 30 s, and a
    warning at step 20, while 40 s of the 60 s deadline have passed, that 1,000 steps will not make it."""
    from megarl.tasks.arithmetic import build_tokenizer, split_problems

    clock = iter(range(10**6))
    monkeypatch.setattr(starter.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(starter, "BATCH", 4)  # the model's steps themselves do not matter here
    tokenizer = build_tokenizer(tmp_path)
    train, _ = split_problems(seed=0)
    with pytest.raises(starter.OutOfTime, match="passed --minutes 1 at step 30 of 1000"):
        starter.pretrain(starter.build_model(tokenizer), tokenizer, train, steps=1000, seed=0, minutes=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step     1/1000")
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning:"))
    assert "at 2.05 s a step the 1000 steps need ~34.2 min, past --minutes 1: the build will stop" in lines[warning]
    steps = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step")]
    assert steps == [1, 17] and warning == 2, lines  # step 17: more than 30 s after step 1


def _dense_and_moe(tmp_path):
    """The tool's dense Qwen3 (one expert wide) with every weight random, norms included, so that a weight copied
    to the wrong place shows in the logits; and the Qwen3-MoE upcycled from it."""
    import torch

    from megarl.tasks.arithmetic import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    dense = starter.build_model(tokenizer, "qwen3", starter.EXPERT_WIDTH)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if p.dim() == 1 else
                    torch.randn(p.shape, generator=gen) * 0.1)
    return tokenizer, dense


def _logits(model, tokens):
    import torch

    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def test_the_upcycled_moe_computes_the_dense_models_function(tmp_path):
    """Every expert a copy of the dense MLP and top-2 weights that sum to 1: the same logits (within 1e-5), while
    the random router already sends different tokens to different experts, which lets the experts part in RL."""
    import torch

    tokenizer, dense = _dense_and_moe(tmp_path)
    torch.manual_seed(1)
    moe = starter.build_model(tokenizer, "qwen3_moe")
    starter.upcycle(dense, moe)
    tokens = torch.randint(0, len(tokenizer), (4, 16), generator=torch.Generator().manual_seed(2))
    assert (_logits(moe, tokens) - _logits(dense, tokens)).abs().max() < 1e-5
    experts = moe.model.layers[0].mlp.experts
    assert all(torch.equal(experts.gate_up_proj[0], experts.gate_up_proj[e]) for e in range(starter.EXPERTS))
    hidden = moe.model.embed_tokens(tokens).reshape(-1, moe.config.hidden_size)
    _, _, chosen = moe.model.layers[0].mlp.gate(moe.model.layers[0].post_attention_layernorm(hidden))
    assert len(chosen.unique()) == starter.EXPERTS and len({tuple(sorted(r)) for r in chosen.tolist()}) > 1


def test_upcycling_refuses_a_moe_whose_routing_weights_do_not_sum_to_one(tmp_path):
    """Without norm_topk_prob a token's two weights are softmax probabilities over all 4 experts: the copies would
    be mixed with weights summing to less than 1, another function."""
    tokenizer, dense = _dense_and_moe(tmp_path)
    moe = starter.build_model(tokenizer, "qwen3_moe")
    moe.config.norm_topk_prob = False
    with pytest.raises(ValueError, match="norm_topk_prob"):
        starter.upcycle(dense, moe)


def test_the_upcycled_starter_is_what_the_moe_recipe_runs(tmp_path):
    """Saved and read back by transformers it still gives the dense logits, and it passes the preflight of
    recipes/tiny_cpu_moe.sh on its 2 processes at EP 2: a qwen3_moe with 4 experts, top-2, in every layer."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.arguments import parse_args
    from megarl.preflight import check_run
    from megarl.tasks.arithmetic import split_problems

    tokenizer, dense = _dense_and_moe(tmp_path)
    _, heldout = split_problems(seed=0)
    out = tmp_path / "starter_moe"
    starter.upcycle_checked(dense, tokenizer, heldout, seed=0).save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokens = torch.randint(0, len(tokenizer), (4, 16), generator=torch.Generator().manual_seed(2))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (_logits(loaded, tokens) - _logits(dense, tokens)).abs().max() < 1e-5
    cfg = parse_args([str(REPO / "recipes/tiny_cpu_moe.sh"), "--hf-checkpoint", str(out)], check_registries=False)
    layout, shape, _ = check_run(cfg, world_size=2)
    assert (shape.family, shape.num_experts, shape.moe_top_k, shape.moe_norm_topk_prob) == ("qwen3_moe", 4, 2, True)
    assert shape.moe_layers == (0, 1) and shape.moe_ffn_hidden_size == dense.config.intermediate_size
    assert cfg.model.expert_model_parallel_size == 2 and cfg.algorithm.routing_replay


def test_the_upcycled_deepseek_v3_computes_the_dense_models_function_and_is_what_its_recipe_runs(tmp_path):
    """DeepSeek-V3 (MLA): the dense model with every weight random; upcycled, its MoE layer's shared expert and
    routed experts each carry half the MLP's output, the router's renormalised top-2 weights sum to 1: the same
    logits within 1e-5 after a save and load by transformers, while the grouped router already picks different
    groups for different tokens. recipes/tiny_cpu_deepseek_v3.sh reads it as a deepseek_v3 with a dense first layer
    and 4 experts (top-2) in 1 of 2 groups, with a shared expert one expert wide."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.arguments import parse_args
    from megarl.preflight import check_run
    from megarl.tasks.arithmetic import build_tokenizer, split_problems

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    dense = starter.build_model(tokenizer, "deepseek_v3", dense=True)
    assert dense.config.first_k_dense_replace == dense.config.num_hidden_layers == 2
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if p.dim() == 1 else
                    torch.randn(p.shape, generator=gen) * 0.1)
    _, heldout = split_problems(seed=0)
    moe = starter.upcycle_checked(dense, tokenizer, heldout, seed=0, family="deepseek_v3")
    out = tmp_path / "starter_deepseek_v3"
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokens = torch.randint(0, len(tokenizer), (4, 16), generator=torch.Generator().manual_seed(2))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (_logits(loaded, tokens) - _logits(dense, tokens)).abs().max() < 1e-5
    layer = loaded.model.layers[1].mlp
    down = dense.model.layers[1].mlp.down_proj.weight
    assert torch.equal(layer.shared_experts.down_proj.weight, 0.5 * down)
    assert all(torch.equal(layer.experts.down_proj[e], 0.5 * down) for e in range(starter.EXPERTS))
    hidden = loaded.model.embed_tokens(tokens).reshape(-1, loaded.config.hidden_size)
    _, _, chosen = layer.gate(hidden)
    assert len({tuple(sorted(r)) for r in chosen.tolist()}) == 2  # both groups of 2 experts are chosen by some token
    cfg = parse_args([str(REPO / "recipes/tiny_cpu_deepseek_v3.sh"), "--hf-checkpoint", str(out)],
                     check_registries=False)
    _, shape, _ = check_run(cfg, world_size=2)
    assert (shape.family, shape.num_experts, shape.moe_top_k, shape.moe_layers) == ("deepseek_v3", 4, 2, (1,))
    assert (shape.moe_num_groups, shape.moe_group_topk, shape.moe_routed_scaling_factor) == (2, 1, 1.0)
    assert shape.moe_shared_ffn_hidden_size == shape.moe_ffn_hidden_size == dense.config.intermediate_size
    assert cfg.model.expert_model_parallel_size == 2 and cfg.algorithm.routing_replay


@pytest.mark.slow
def test_a_build_stopped_by_sigterm_leaves_no_partial_directory(tmp_path):
    """kill (SIGTERM) in the middle of a build: the partial directory is removed and nothing is written."""
    import signal
    import subprocess

    script = ("import time; from tools.make_starter_model import write_atomically\n"
              "def build(tmp):\n    (tmp / 'part').write_text('x'); print('building', flush=True); time.sleep(60)\n"
              f"write_atomically(__import__('pathlib').Path({str(tmp_path / 'out')!r}), False, build, 'test')\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "building"
    assert any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "stopped by signal 15; nothing written" in err
    assert list(tmp_path.iterdir()) == [], "neither the partial directory nor the output remains"
