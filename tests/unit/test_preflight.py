"""What `megarl.preflight` finds before any work: the layout, a checkpoint's config.json, the lengths, `--load`.

Every problem a config.json can reveal stops the run once, with exit status 2 and no traceback: checked here on
the functions, through `python megarl/train.py`, through torchrun, and through the launchers' pre-launch check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env, torchrun

from megarl.config import ConfigError, build_config
from megarl.checkpoint_layout import find_resume
from megarl.preflight import check_run, padded_vocab_size, prompt_limit, resolve_load

QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 97, "max_position_embeddings": 64}


def checkpoint_dir(root: Path, name: str = "ckpt", weights: bool = True, **fields) -> Path:
    """An HF checkpoint directory as far as preflight reads one: config.json, and a weights file's name."""
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**QWEN2, **fields}))
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    return d


def check(hf: Path, world: int = 1, **flags):
    return check_run(build_config({"hf_checkpoint": str(hf), "max_response_len": 16, **flags}), world)


@pytest.mark.parametrize("fields, flags, world, message", [
    ({"model_type": "gpt_neox"}, {}, 1, "model_type 'gpt_neox' is not supported; supported: deepseek_v3, llama, qwen2"),
    ({"use_sliding_window": True, "sliding_window": 32}, {}, 1, "sliding-window attention layers are not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, {}, 1, "sliding-window attention layers"),
    ({"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 96}, {"tensor_model_parallel_size": 2}, 2,
     "num_key_value_heads = 3 is not divisible by --tensor-model-parallel-size 2 (the largest TP below 2 that "
     "divides this model: 1)"),
    ({}, {"tensor_model_parallel_size": 8}, 8, "num_attention_heads = 4 is not divisible by "
     "--tensor-model-parallel-size 8 (the largest TP below 8 that divides this model: 2)"),
    ({"intermediate_size": 130}, {"tensor_model_parallel_size": 4}, 4, "intermediate_size = 130 is not divisible"),
    ({}, {"pipeline_model_parallel_size": 3}, 3, "num_hidden_layers = 4 is not divisible by "
     "--pipeline-model-parallel-size 3"),
    ({}, {"max_response_len": 64}, 1, "--max-response-len 64 leaves no room for a prompt in the model's 64 positions"),
    ({}, {"max_prompt_len": 50}, 1, "--max-prompt-len 50 + --max-response-len 16 = 66 tokens exceed the model's 64 "
     "positions (max_position_embeddings)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {}, 1, "rope type 'yarn' is not supported yet"),
    ({"hidden_act": "gelu"}, {}, 1, "hidden_act 'gelu' is not supported"),
])
def test_each_config_json_problem_is_named(tmp_path, fields, flags, world, message):
    with pytest.raises(ConfigError) as e:
        check(checkpoint_dir(tmp_path, **fields), world, **flags)
    assert message in str(e.value)


def test_every_problem_is_listed_at_once(tmp_path):
    hf = checkpoint_dir(tmp_path, num_key_value_heads=3, num_attention_heads=6, hidden_size=96, weights=False)
    with pytest.raises(ConfigError) as e:
        check(hf, 2, tensor_model_parallel_size=2, pipeline_model_parallel_size=3, max_prompt_len=60)
    text = str(e.value)
    assert text.startswith("the run cannot start as configured (5 problems):")
    for part in ("the world size 2 (processes, GPUs) is not divisible", "num_key_value_heads = 3",
                 "num_hidden_layers = 4", "exceed the model's 64 positions", "no *.safetensors weight files"):
        assert part in text


def test_missing_and_broken_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="--hf-checkpoint is required"):
        check_run(build_config({}), 1)
    with pytest.raises(ConfigError, match=r"not an HF checkpoint directory \(no config.json\)"):
        check(tmp_path / "nowhere")
    hf = checkpoint_dir(tmp_path)
    (hf / "config.json").write_text(json.dumps({k: v for k, v in QWEN2.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        check(hf)


def test_a_reference_of_another_architecture_is_refused(tmp_path):
    hf = checkpoint_dir(tmp_path)
    ref = checkpoint_dir(tmp_path, "ref", num_hidden_layers=2)
    with pytest.raises(ConfigError, match="--ref-checkpoint .*: its architecture differs"):
        check(hf, ref_checkpoint=str(ref))


def test_a_vocabulary_tp_does_not_divide_is_padded_not_refused(tmp_path):
    layout, shape, _ = check(checkpoint_dir(tmp_path), 2, tensor_model_parallel_size=2)
    assert (layout.tp, shape.vocab_size) == (2, 97)
    assert padded_vocab_size(97, 1, 2) == 98 and padded_vocab_size(97, 4, 3) == 108
    assert padded_vocab_size(151936, 128, 1) == 151936 and padded_vocab_size(151936, 128, 2) == 152064  # Megatron's


def test_the_prompt_limit_is_what_the_context_leaves(tmp_path):
    _, shape, _ = check(checkpoint_dir(tmp_path))
    assert prompt_limit(build_config({"max_response_len": 16}), shape) == 48
    assert prompt_limit(build_config({"max_response_len": 16, "max_prompt_len": 20}), shape) == 20


# ---------------------------------------------------------------------------------------------------- --load

def _fake_checkpoint(root: Path, step: int, padded: int | None = None) -> Path:
    it = root / f"iter_{step:07d}"
    it.mkdir(parents=True)
    (it / "trainer_state.pkl").write_bytes(b"")
    if padded is not None:
        (it / "config.json").write_text(json.dumps({"padded_vocab_size": padded}))
    (root / "latest").write_text(it.name + "\n")
    return it


def test_load_resolves_latest_a_step_or_nothing(tmp_path):
    root = tmp_path / "ck"
    assert resolve_load(str(root)) is None, "no directory yet: a fresh start"
    root.mkdir()
    assert resolve_load(str(root)) is None, "an empty directory: a fresh start"
    first, second = _fake_checkpoint(root, 5), _fake_checkpoint(root, 10)
    assert resolve_load(str(root)) == second
    assert resolve_load(str(root), 5) == first
    assert resolve_load(str(first)) == first, "an iter_N directory itself"
    with pytest.raises(ConfigError, match=r"--ckpt-step 7: no iter_0000007 under --load .* "
                                          r"\(complete steps there: 5, 10\)"):
        resolve_load(str(root), 7)
    (root / "latest").write_text("iter_0000099\n")  # names a lost checkpoint: named, and the newest whole one taken
    assert resolve_load(str(root)) == second
    assert "iter_0000099: 'latest' names it, but it does not exist" in find_resume(root)[1]
    (root / "latest").write_text("iter_0000007\n")
    assert resolve_load(str(root)) == first, "never a checkpoint newer than the one 'latest' names"


def test_a_mistyped_load_never_starts_over_a_saved_run(tmp_path):
    hf, saved = checkpoint_dir(tmp_path), tmp_path / "run"
    _fake_checkpoint(saved, 3)
    with pytest.raises(ConfigError, match=r"--load .*typo holds no checkpoint, but --save .*run does \(iter_0000003\)"):
        check(hf, load=str(tmp_path / "typo"), save=str(saved))
    assert check(hf, load=str(saved), save=str(saved))[2] == saved / "iter_0000003"


def test_a_checkpoint_with_another_vocabulary_padding_is_refused(tmp_path):
    hf, root = checkpoint_dir(tmp_path), tmp_path / "ck"
    _fake_checkpoint(root, 2, padded=108)  # 97 rows saved at TP 3 with --make-vocab-size-divisible-by 4
    with pytest.raises(ConfigError, match="holds a vocabulary padded to 108 rows; this run .* pads 97 to 98; "
                                          "--make-vocab-size-divisible-by 54 keeps the saved 108 rows at TP 2"):
        check(hf, 2, tensor_model_parallel_size=2, load=str(root))
    assert check(hf, 2, tensor_model_parallel_size=2, make_vocab_size_divisible_by=54, load=str(root))[2] is not None


# ------------------------------------------------------------------------------------- through the entrypoints

def _train(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "megarl/train.py", *map(str, args)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
    ({"use_sliding_window": True, "sliding_window": 32}, "sliding-window attention layers are not supported"),
])
@pytest.mark.slow
def test_train_py_stops_with_exit_2_and_no_traceback(tmp_path, fields, message):
    proc = _train("--hf-checkpoint", checkpoint_dir(tmp_path, **fields), "--prompt-data", tmp_path / "none.jsonl")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count(message) == 1, proc.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_under_torchrun_rank_0_says_it_once_and_exits_2(tmp_path):
    hf = checkpoint_dir(tmp_path, num_key_value_heads=3, num_attention_heads=6, hidden_size=96)
    proc = torchrun(2, "megarl/train.py", "--hf-checkpoint", hf, "--tensor-model-parallel-size", 2, check=False,
                    timeout=120)
    message = "num_key_value_heads = 3 is not divisible by --tensor-model-parallel-size 2"
    assert proc.stderr.count(message) == 1, proc.stderr
    assert "megarl: rank" not in proc.stderr, "no rank failed with an exception"
    # torchrun's report: rank 0 exited 2 first (the others wait before exiting, and torchrun stops them then)
    assert "Root Cause (first observed failure):\n[0]:" in proc.stderr and "rank      : 0" in proc.stderr
    assert "exitcode  : 2" in proc.stderr.split("Root Cause")[1], proc.stderr


def test_the_launchers_pre_launch_check_reads_config_json(tmp_path):
    hf = checkpoint_dir(tmp_path, num_key_value_heads=3, num_attention_heads=6, hidden_size=96)
    proc = subprocess.run([sys.executable, "launch/render.py", "check", "--world-size", "8", "--",
                           "--hf-checkpoint", str(hf), "--tensor-model-parallel-size", "2"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "num_key_value_heads = 3 is not divisible by --tensor-model-parallel-size 2" in proc.stderr
    unseen = subprocess.run([sys.executable, "launch/render.py", "check", "--world-size", "8", "--",
                             "--hf-checkpoint", "/not/mounted/here", "--tensor-model-parallel-size", "2"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert unseen.returncode == 0 and "TP=2" in unseen.stdout and "checked when the job starts" in unseen.stderr


MOE = {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "norm_topk_prob": True}


@pytest.mark.parametrize("fields, flags, world, message", [
    ({}, {"expert_model_parallel_size": 2}, 2, "--expert-model-parallel-size 2 / --expert-tensor-parallel-size 0: "
     "a qwen2 model has no experts (the families with experts: deepseek_v3, qwen3_moe)"),
    ({}, {"routing_replay": True}, 1, "--routing-replay: a qwen2 model has no routers to replay"),
    (MOE, {"expert_model_parallel_size": 3}, 3, "num_experts = 4 is not divisible by --expert-model-parallel-size 3 "
     "(the largest EP below 3 that divides it: 2)"),
    (MOE, {"expert_model_parallel_size": 4}, 2, "the world size 2 is not divisible by --expert-tensor-parallel-size 1 "
     "x --expert-model-parallel-size 4 x --pipeline-model-parallel-size 1"),
    (MOE, {"tensor_model_parallel_size": 2}, 2, "a mixture-of-experts model trains at --tensor-model-parallel-size 2 "
     "only with --sequence-parallel"),
    ({**MOE, "moe_intermediate_size": 30}, {"tensor_model_parallel_size": 4, "sequence_parallel": True}, 4,
     "moe_intermediate_size = 30 is not divisible by --expert-tensor-parallel-size 4"),
    ({**MOE, "shared_expert_intermediate_size": 64}, {}, 1, "shared experts are not supported for qwen3_moe"),
])
def test_each_expert_problem_is_named(tmp_path, fields, flags, world, message):
    with pytest.raises(ConfigError) as e:
        check(checkpoint_dir(tmp_path, **fields), world, **flags)
    assert message in str(e.value)


def test_a_qwen3_moe_layout_that_fits_passes(tmp_path):
    layout, shape, _ = check(checkpoint_dir(tmp_path, **MOE), 4, tensor_model_parallel_size=2, sequence_parallel=True,
                             expert_model_parallel_size=2, expert_tensor_parallel_size=2, routing_replay=True)
    assert (layout.tp, layout.dp, shape.num_experts, shape.moe_layers) == (2, 2, 4, (0, 1, 2, 3))


def test_routing_replay_needs_the_builtin_engine():
    with pytest.raises(ConfigError, match="--routing-replay needs --rollout-backend builtin"):
        build_config({"routing_replay": True, "rollout_backend": "sglang"})
