"""Typed config from bash recipes and the command line (`megarl/config.py`).

Recipes are real bash run by `read_recipe`, so these tests write small recipes into tmp_path; the last group
parses the repository's own recipes and checks the values written in them.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from megarl.arguments import help_text, parse_args
from megarl.config import SECTIONS, Config, ConfigError, read_recipe

REPO = Path(__file__).resolve().parents[2]

# A model-shape file kept beside the recipe, as recipes/models/<m>.sh is: the recipe finds it through
# ${BASH_SOURCE[0]}, which only works if read_recipe sources the file by its own path.
MODEL_SH = """\
# model shape: where the checkpoint is and how to split it
CKPT_ROOT=/ckpts
MODEL_ARGS=(
  --hf-checkpoint "$CKPT_ROOT/tiny"   # a comment inside the array
  --tensor-model-parallel-size 2
  --transformer-impl local
)
"""

RECIPE_SH = """\
# A test recipe: comments, variables, arithmetic, a value with spaces, a sourced sibling.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/models/tiny.sh"
echo "recipes may print; this must not become a flag"
GROUP=4

ROLLOUT_ARGS=(
  --n-samples-per-prompt $GROUP
  # a whole-line comment between flags
  --max-response-len $((GROUP * 16))     # 64
  --rollout-top-k -1
  --rollout-top-p 0.95
)

DATA_ARGS=(
  --prompt-data "$HERE/my data/train set.jsonl"
  --rollout-batch-size $((GROUP * 2 + 1))
)

TRAINING_ARGS=(
  --num-steps 7
  --lr 3e-5
  --seed 99
)
"""


@pytest.fixture
def recipe(tmp_path) -> Path:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.sh").write_text(MODEL_SH)
    path = tmp_path / "recipe.sh"
    path.write_text(RECIPE_SH)
    return path


def write_recipe(tmp_path: Path, text: str, name: str = "r.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ recipes


def test_read_recipe_returns_flags_in_array_order(recipe):
    here = str(recipe.parent.resolve())
    assert read_recipe(recipe) == [
        "--hf-checkpoint", "/ckpts/tiny", "--tensor-model-parallel-size", "2", "--transformer-impl", "local",
        "--n-samples-per-prompt", "4", "--max-response-len", "64", "--rollout-top-k", "-1", "--rollout-top-p", "0.95",
        "--prompt-data", f"{here}/my data/train set.jsonl", "--rollout-batch-size", "9",
        "--num-steps", "7", "--lr", "3e-5", "--seed", "99",
    ]


def test_recipe_parses_to_typed_values(recipe, monkeypatch, tmp_path):
    # Run from another directory: the sibling file must be found relative to the recipe, not the cwd.
    monkeypatch.chdir(tmp_path / "models")
    cfg = parse_args([str(recipe)])
    assert isinstance(cfg, Config)
    assert cfg.model.hf_checkpoint == "/ckpts/tiny"
    assert cfg.model.tensor_model_parallel_size == 2 and type(cfg.model.tensor_model_parallel_size) is int
    assert cfg.model.transformer_impl == "local"
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.rollout.max_response_len == 64
    assert cfg.rollout.rollout_top_k == -1
    assert cfg.rollout.rollout_top_p == 0.95 and type(cfg.rollout.rollout_top_p) is float
    assert cfg.data.prompt_data == f"{recipe.parent.resolve()}/my data/train set.jsonl"
    assert cfg.data.rollout_batch_size == 9
    assert cfg.training.num_steps == 7
    assert cfg.training.lr == 3e-5 and type(cfg.training.lr) is float
    assert cfg.training.seed == 99
    # Untouched settings keep their dataclass defaults.
    assert cfg.model.pipeline_model_parallel_size == 1
    assert cfg.algorithm.advantage_estimator == "grpo"
    assert cfg.data.shuffle is True and cfg.model.bf16 is False


def test_command_line_overrides_recipe(recipe):
    cfg = parse_args([str(recipe), "--num-steps", "3", "--tensor-model-parallel-size=1", "--lr", "1e-3"])
    assert cfg.training.num_steps == 3
    assert cfg.model.tensor_model_parallel_size == 1
    assert cfg.training.lr == 1e-3
    assert cfg.training.seed == 99  # not overridden


def test_later_array_overrides_earlier_and_extra_args_arrays_are_read(tmp_path):
    # Arrays outside the known order (here CUSTOM_ARGS) are read after the known ones; the last value wins.
    path = write_recipe(tmp_path, "TRAINING_ARGS=(--seed 1 --num-steps 2)\nMODEL_ARGS=(--seed 5)\n"
                        "CUSTOM_ARGS=(--num-steps 9)\n")
    cfg = parse_args([str(path)])
    assert cfg.training.seed == 1  # MODEL_ARGS comes before TRAINING_ARGS whatever the file order
    assert cfg.training.num_steps == 9


def test_non_array_args_variables_are_ignored(tmp_path):
    path = write_recipe(tmp_path, 'NOTE_ARGS="--seed 5"\nTRAINING_ARGS=(--seed 6)\n')
    assert read_recipe(path) == ["--seed", "6"]


# ------------------------------------------------------------------------------------------------ flag forms


def test_equals_form():
    cfg = parse_args(["--rollout-backend=sglang", "--num-steps=12", "--output-dir=a b=c"])
    assert cfg.rollout.rollout_backend == "sglang"
    assert cfg.training.num_steps == 12
    assert cfg.logging.output_dir == "a b=c"  # only the first '=' separates flag and value


def test_defaults_without_any_flags():
    cfg = parse_args([])
    assert cfg.training.num_steps == 100 and cfg.rollout.rollout_backend == "builtin" and cfg.data.shuffle is True


@pytest.mark.parametrize(
    "argv, bf16, shuffle",
    [
        (["--bf16"], True, True),
        (["--bf16", "true"], True, True),
        (["--bf16", "--seed", "3"], True, True),  # a bare bool flag does not swallow the next flag
        (["--no-shuffle"], False, False),
        (["--shuffle", "false"], False, False),
        (["--shuffle", "0"], False, False),
        (["--shuffle=false"], False, False),
        (["--shuffle=off"], False, False),
        (["--no-shuffle", "--shuffle"], False, True),  # the last one wins
        (["--bf16=no"], False, True),
        (["--no-bf16"], False, True),
    ],
)
def test_bool_flags(argv, bf16, shuffle):
    cfg = parse_args(argv)
    assert cfg.model.bf16 is bf16
    assert cfg.data.shuffle is shuffle


def test_bare_bool_flag_then_positional_value_is_an_error():
    # "--bf16 maybe" is not a bool value, so --bf16 is bare and "maybe" is a stray token.
    with pytest.raises(ConfigError, match="expected a --flag, got 'maybe'"):
        parse_args(["--bf16", "maybe"])


def test_bool_equals_form_rejects_non_bool():
    with pytest.raises(ConfigError, match=r"--shuffle expects true/false, got 'maybe'"):
        parse_args(["--shuffle=maybe"])


def test_negated_bool_flag_with_inline_value_is_not_silently_inverted():
    with pytest.raises(ConfigError, match="--no-shuffle takes no value"):
        parse_args(["--no-shuffle=true"])


@pytest.mark.parametrize("argv", [["--no-seed", "5"], ["--no-rollout-backend", "sglang"]])
def test_no_prefix_only_applies_to_bool_flags(argv):
    with pytest.raises(ConfigError, match=f"unknown flag {argv[0]}"):
        parse_args(argv)


# ------------------------------------------------------------------------------------------------ errors


def test_unknown_flag_on_command_line_suggests_close_ones():
    with pytest.raises(ConfigError) as e:
        parse_args(["--rollout-batchsize", "8"])
    msg = str(e.value)
    assert msg.startswith("command line:")
    assert "unknown flag --rollout-batchsize" in msg
    assert "--rollout-batch-size" in msg


def test_unknown_flag_in_recipe_names_the_recipe(tmp_path):
    path = write_recipe(tmp_path, "TRAINING_ARGS=(\n  --num-step 10\n)\n")
    with pytest.raises(ConfigError) as e:
        parse_args([str(path)])
    msg = str(e.value)
    assert f"recipe {path}" in msg
    assert "command line" not in msg
    assert "unknown flag --num-step" in msg and "--num-steps" in msg


def test_unknown_flag_without_close_match_points_to_help():
    with pytest.raises(ConfigError, match=r"unknown flag --zzzzzzzz; run with --help"):
        parse_args(["--zzzzzzzz", "1"])


def test_stray_value_is_an_error():
    with pytest.raises(ConfigError, match="command line: expected a --flag, got 'oops'"):
        parse_args(["--seed", "1", "oops"])


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        parse_args(["--advantage-estimator", "ppo"])
    msg = str(e.value)
    assert "--advantage-estimator" in msg and "'ppo'" in msg
    assert "grpo" in msg and "dr_grpo" in msg


def test_bad_literal_in_recipe_names_recipe(tmp_path):
    path = write_recipe(tmp_path, "ROLLOUT_ARGS=(--rollout-backend tensorrt_llm)\n")
    with pytest.raises(ConfigError) as e:
        parse_args([str(path)])
    assert f"recipe {path}" in str(e.value)
    assert "choose one of: builtin, megatron, sglang, vllm" in str(e.value)


@pytest.mark.parametrize("flag, raw, kind", [("--num-steps", "ten", "int"), ("--num-steps", "2.5", "int"),
                                             ("--lr", "fast", "float")])
def test_non_numeric_value(flag, raw, kind):
    with pytest.raises(ConfigError, match=f"{flag} expects {kind}, got '{raw}'"):
        parse_args([flag, raw])


def test_value_missing_at_end():
    with pytest.raises(ConfigError, match="command line: --seed needs a value"):
        parse_args(["--num-steps", "3", "--seed"])


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--num-steps", "0"], r"--num-steps must be >= 1, got 0"),
        (["--micro-batch-size", "-2"], r"--micro-batch-size must be >= 1, got -2"),
        (["--tensor-model-parallel-size", "0"], r"--tensor-model-parallel-size must be >= 1"),
        (["--rollout-batch-size", "0"], r"--rollout-batch-size must be >= 1"),
        (["--rollout-top-p", "1.5"], r"--rollout-top-p must be in \(0, 1\], got 1.5"),
        (["--rollout-top-p", "0"], r"--rollout-top-p must be in \(0, 1\]"),
        (["--rollout-temperature", "0"], r"--rollout-temperature must be > 0"),
        (["--kl-coef", "-0.1"], r"--kl-coef must be >= 0"),
        (["--eps-clip", "0"], r"--eps-clip"),
        (["--lr", "0"], r"--lr must be > 0"),
        (["--log-interval", "0"], r"--log-interval must be >= 1"),
    ],
)
def test_out_of_range_values(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_args(argv)


def test_boundary_values_are_accepted():
    cfg = parse_args(["--rollout-top-p", "1", "--num-steps", "1", "--kl-coef", "0"])
    assert (cfg.rollout.rollout_top_p, cfg.training.num_steps, cfg.algorithm.kl_coef) == (1.0, 1, 0.0)


def test_missing_recipe_file(tmp_path):
    missing = tmp_path / "nope.sh"
    with pytest.raises(ConfigError, match=f"recipe {missing}: no such file"):
        parse_args([str(missing)])


def test_recipe_that_exits_nonzero_reports_exit_code_and_stderr(tmp_path):
    path = write_recipe(tmp_path, 'echo "MODEL_DIR is not set" >&2\nexit 3\n')
    with pytest.raises(ConfigError) as e:
        read_recipe(path)
    msg = str(e.value)
    assert f"recipe {path}" in msg and "exit 3" in msg and "MODEL_DIR is not set" in msg


def test_recipe_with_bash_syntax_error(tmp_path):
    path = write_recipe(tmp_path, "MODEL_ARGS=(\n  --seed 1\n  $((1 +)) \n)\n")
    with pytest.raises(ConfigError) as e:
        read_recipe(path)
    msg = str(e.value)
    assert f"recipe {path}: bash failed" in msg and "syntax error" in msg


def test_recipe_failing_command_stops_it(tmp_path):
    # The recipe runs under `set -e`: a failing command is an error, not a silently half-read recipe.
    path = write_recipe(tmp_path, "source /no/such/model.sh\nMODEL_ARGS=(--seed 1)\n")
    with pytest.raises(ConfigError, match=r"/no/such/model.sh"):
        read_recipe(path)


# ------------------------------------------------------------------------------------------------ contract


def all_fields():
    return [(section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def test_sections_cover_config():
    own = [f.name for f in dataclasses.fields(Config) if f.name not in ("origins", "components")]
    assert own == list(SECTIONS)
    assert {name: typing.get_type_hints(Config)[name] for name in own} == SECTIONS


def test_component_options_are_flags_with_help_and_defaults_like_megarls_own():
    from megarl.arguments import components

    text, cfg = help_text(), parse_args([])
    for section, cls in components().items():
        assert f"{section}:" in text.splitlines()
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            lines = [line for line in text.splitlines() if line.strip().startswith(flag + " ")]
            assert len(lines) == 1 and f.metadata["help"] in lines[0] and f"(default {f.default!r})" in lines[0]
            assert getattr(cfg.components[section], f.name) == f.default


def test_every_field_has_help():
    undocumented = [f"{s}.{f.name}" for s, f in all_fields() if not str(f.metadata.get("help", "")).strip()]
    assert undocumented == []


def test_flag_names_are_unique_across_sections():
    names = [f.name for _, f in all_fields()]
    assert len(names) == len(set(names)) and len(names) > 40


def test_help_text_lists_every_field_with_its_help():
    text = help_text()
    for _section, f in all_fields():
        flag = "--" + f.name.replace("_", "-")
        lines = [line for line in text.splitlines() if line.strip().startswith(flag + " ")]
        assert len(lines) == 1, flag
        assert f.metadata["help"] in lines[0]
        assert f"(default {f.default!r})" in lines[0]
    for section in SECTIONS:
        assert f"{section}:" in text.splitlines()
    assert "<dr_grpo|gae|grpo|reinforce_pp|reinforce_pp_baseline|rloo>" in text  # the registry's names


def test_every_field_default_builds_a_valid_config():
    cfg = parse_args([])
    for section, f in all_fields():
        assert getattr(getattr(cfg, section), f.name) == f.default


# ------------------------------------------------------------------------------------------------ real recipes


@pytest.fixture
def clean_env(monkeypatch):
    # The recipes take these from the environment when set; the tests check the defaults written in them.
    for var in ("STARTER_DIR", "MODEL_DIR", "DATA_DIR", "REPO_ROOT"):
        monkeypatch.delenv(var, raising=False)


def test_tiny_cpu_recipe(clean_env):
    root = str(REPO)
    starter = f"{root}/.cache/starter"
    cfg = parse_args([str(REPO / "recipes/tiny_cpu.sh")])
    assert cfg.model.hf_checkpoint == starter
    assert (cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (1, 1)
    assert cfg.model.transformer_impl == "local"
    assert cfg.rollout.rollout_backend == "builtin"
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.rollout.rollout_temperature == 1.0
    assert cfg.rollout.max_response_len == 8
    assert cfg.data.prompt_data == f"{starter}/train.jsonl"
    assert cfg.data.eval_data == f"{starter}/heldout.jsonl"
    assert cfg.data.rollout_batch_size == 8
    assert (cfg.algorithm.advantage_estimator, cfg.algorithm.eps_clip, cfg.algorithm.kl_coef) == ("grpo", 0.2, 0.0)
    assert (cfg.algorithm.kl_estimator, cfg.algorithm.loss_aggregation) == ("k3", "token-mean")
    assert (cfg.training.num_steps, cfg.training.max_train_minutes, cfg.training.lr) == (5400, 0.0, 1.5e-4)
    assert (cfg.training.min_lr, cfg.training.lr_decay_style) == (1e-5, "linear")
    assert (cfg.training.micro_batch_size, cfg.training.seed) == (32, 1234)
    assert cfg.logging.output_dir == f"{root}/runs/tiny_cpu"
    assert (cfg.logging.log_interval, cfg.logging.eval_samples_per_prompt) == (10, 4)


def test_tiny_cpu_recipe_honours_env_and_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv("STARTER_DIR", str(tmp_path))
    cfg = parse_args([str(REPO / "recipes/tiny_cpu.sh"), "--num-steps", "5", "--max-train-minutes", "0"])
    assert cfg.model.hf_checkpoint == str(tmp_path)
    assert cfg.data.prompt_data == f"{tmp_path}/train.jsonl"
    assert (cfg.training.num_steps, cfg.training.max_train_minutes) == (5, 0.0)


def test_tiny_cpu_ppo_rm_recipe(clean_env, monkeypatch, tmp_path):
    """The four-model PPO demo: PPO's GAE from tiny_cpu_ppo.sh, every row scored by the reward model alone (the
    verifier's outcome kept), normalised scores, 32 prompts a step, and a clear error while the model is unbuilt."""
    from helpers import make_tiny_reward_model

    monkeypatch.setenv("REWARD_MODEL_DIR", str(tmp_path / "unbuilt"))
    with pytest.raises(ConfigError, match=r"--reward-model .*/unbuilt: no config.json"):
        parse_args([str(REPO / "recipes/tiny_cpu_ppo_rm.sh")])
    rm = make_tiny_reward_model(tmp_path / "rm", seed=0)
    monkeypatch.setenv("REWARD_MODEL_DIR", str(rm))
    cfg = parse_args([str(REPO / "recipes/tiny_cpu_ppo_rm.sh")])
    gae = cfg.components["advantage_estimator.gae"]
    assert (cfg.algorithm.advantage_estimator, gae.gae_gamma, gae.gae_lambda) == ("gae", 1.0, 1.0)
    assert (cfg.data.default_verifier, cfg.data.verifier_key) == ("hf_rm + 0*arithmetic", "reward_spec")
    hf_rm = cfg.components["reward_model.hf_rm"]
    assert hf_rm.reward_model == str(rm) and hf_rm.reward_model_normalize is True
    assert (cfg.data.rollout_batch_size, cfg.rollout.n_samples_per_prompt, hf_rm.reward_model_batch_size) == \
        (32, 8, 128)
    assert (cfg.training.num_steps, cfg.training.lr, cfg.training.min_lr, cfg.training.critic_lr) == \
        (1200, 1.5e-4, 1e-5, 1e-4)
    assert (cfg.training.micro_batch_size, cfg.logging.eval_interval) == (128, 300)
    assert cfg.logging.output_dir == f"{REPO}/runs/tiny_cpu_ppo_rm"


def test_r1_math_recipe(clean_env):
    root = str(REPO)
    cfg = parse_args([str(REPO / "recipes/r1_math.sh")])
    assert cfg.model.hf_checkpoint == "/models/Qwen2.5-Math-1.5B"
    assert (cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (2, 1)
    assert cfg.model.transformer_impl == "transformer_engine" and cfg.model.bf16 is True
    assert cfg.rollout.rollout_backend == "sglang"
    assert (cfg.rollout.n_samples_per_prompt, cfg.rollout.max_response_len, cfg.data.max_prompt_len) == (8, 3072, 1024)
    assert cfg.data.prompt_data == "/data/dapo-math/train.jsonl"
    assert cfg.data.eval_data == "/data/dapo-math/aime24.jsonl"
    assert cfg.data.default_verifier == "math" and cfg.data.rollout_batch_size == 128
    assert (cfg.algorithm.eps_clip, cfg.algorithm.eps_clip_high, cfg.algorithm.kl_coef) == (0.2, 0.28, 0.0)
    assert (cfg.training.num_steps, cfg.training.lr, cfg.training.lr_warmup_steps) == (500, 1e-6, 10)
    assert (cfg.training.weight_decay, cfg.training.clip_grad) == (0.1, 1.0)
    assert (cfg.training.micro_batch_size, cfg.training.updates_per_rollout, cfg.training.seed) == (4, 4, 42)
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval) == (f"{root}/checkpoints/r1_math", 20)
    assert (cfg.logging.output_dir, cfg.logging.log_interval) == (f"{root}/runs/r1_math", 1)


def test_rules_across_sections_are_checked_when_parsing():
    with pytest.raises(ConfigError, match="--max-tokens-per-micro-batch needs --pipeline-model-parallel-size 1"):
        parse_args(["--max-tokens-per-micro-batch", "64", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--context-parallel-size > 1 is not supported with --advantage-estimator "
                                          "gae: its critic"):
        parse_args(["--context-parallel-size", "2", "--advantage-estimator", "gae"])
    assert parse_args(["--context-parallel-size", "2"]).model.context_parallel_size == 2  # the machine decides


def test_plugins_that_do_not_import_stop_the_parse(tmp_path):
    bad = tmp_path / "broken_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="--plugins .*broken_plugin.py: importing 'broken_plugin' failed: "
                                          "RuntimeError: boom"):
        parse_args(["--plugins", str(bad)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--plugins", str(tmp_path / "absent.py")])
    with pytest.raises(ConfigError, match="importing 'no_such_module_anywhere' failed: ModuleNotFoundError"):
        parse_args(["--plugins", "no_such_module_anywhere"])


def test_verifier_options_are_the_verifiers_own_arguments():
    from megarl.reward import reward_options
    from megarl.verifiers import VERIFIERS

    cfg = parse_args(["--code-reward", "fraction", "--code-early-stop", "--code-extract", "first", "--sandbox",
                      "docker", "--sandbox-workers", "3", "--sandbox-image", "img:1", "--code-test-seconds", "2.5",
                      "--code-memory-mb", "512", "--math-strategy", "strict"])
    options = reward_options(cfg)
    code, math = VERIFIERS.build("code", **options["code"]), VERIFIERS.build("math", **options["math"])
    assert (code.reward, code.early_stop, code.extract, code.backend, code.workers, code.image, code.time_s,
            code.memory_mb) == ("fraction", True, "first", "docker", 3, "img:1", 2.5, 512)
    assert math.strategy == "strict"
    defaults = reward_options(parse_args([]))
    assert defaults["code"]["image"] is None and defaults["code"]["backend"] == "local"


# ------------------------------------------------------------------------------------- the saved config.json

def test_a_saved_config_reads_back_as_the_same_config(recipe, tmp_path):
    import json

    from megarl.config import saved_config

    cfg = parse_args([str(recipe), "--lr", "2e-5", "--no-shuffle", "--bf16"], check_registries=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved_config(cfg, world_size=4)))
    again = parse_args([str(path)], check_registries=False)
    assert again == cfg and again.training.lr == 2e-5 and again.data.shuffle is False and again.model.bf16 is True
    assert again.origins["lr"] == f"config {path}"
    assert parse_args([str(path), "--lr", "1e-5"], check_registries=False).training.lr == 1e-5  # flags after it win
    assert cfg.non_default_flags()["training"][:4] == ["--num-steps", "7", "--lr", "2e-05"]
    assert "--no-shuffle" in cfg.non_default_flags()["data"] and "--bf16" in cfg.non_default_flags()["model"]


def test_a_config_saved_before_the_verifiers_declared_their_options_reads_back(tmp_path):
    """The code, math and reward-model settings were once fields of the `reward` section: a config.json written
    then gives the same settings now (read by name; the flags did not change)."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"megarl_version": "0.1.0", "config": {
        "reward": {"reward_workers": 2, "code_reward": "fraction", "math_strategy": "strict",
                   "reward_model_batch_size": 4, "judge_scale": 5.0},
        "sandbox": {"sandbox": "docker"}}}))
    cfg = parse_args([str(path)])
    assert cfg.reward.reward_workers == 2 and cfg.sandbox.sandbox == "docker"
    assert cfg.components["verifier.code"].code_reward == "fraction"
    assert cfg.components["verifier.math"].math_strategy == "strict"
    assert cfg.components["reward_model.hf_rm"].reward_model_batch_size == 4
    assert cfg.components["reward_model.llm_judge"].judge_scale == 5.0
    assert json.loads(json.dumps(cfg.to_dict()))["verifier.code"]["code_reward"] == "fraction"  # saved anew


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a readable JSON file"),
    ('{"megarl_version": "0.1.0"}', 'no "config" object'),
    ('{"megarl_version": "9.9", "config": {"training": {"lr_schedule": "x"}}}',
     "unknown setting training.lr_schedule (written by megarl 9.9; this is a different version)"),
    ('{"config": {"training": {"num_steps": "many"}}}', "--num-steps expects int, got 'many'"),
])
def test_a_broken_saved_config_is_named(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_args([str(path)], check_registries=False)
    assert str(e.value).startswith(f"config {path}: ") and message in str(e.value)


def test_tool_flags_are_checked_and_reach_the_tools():
    from megarl.tool_calls import tool_settings

    cfg = parse_args(["--rollout-function", "tool_use", "--tool-parser", "python", "--tool-timeout", "1.5",
                      "--tool-memory-mb", "64", "--tool-output-bytes", "100", "--tool-workers", "3", "--sandbox",
                      "docker", "--sandbox-image", "img:2"])
    s = tool_settings(cfg.components["rollout_function.tool_use"], cfg.sandbox)
    assert (s.timeout_s, s.memory_mb, s.output_bytes, s.workers, s.sandbox, s.image) == (1.5, 64, 100, 3, "docker",
                                                                                         "img:2")
    with pytest.raises(ConfigError, match=r"--tools 'nope' is not registered; choose one of: .*python"):
        parse_args(["--tools", "python,nope"])
    with pytest.raises(ConfigError, match=r"--tool-parser 'json' is not registered; choose one of: hermes, python"):
        parse_args(["--tool-parser", "json"])
    with pytest.raises(ConfigError, match="--max-turns must be >= 1, got 0"):
        parse_args(["--max-turns", "0"])
    with pytest.raises(ConfigError, match="--tool-timeout must be > 0 seconds"):
        parse_args(["--tool-timeout", "0"])
    with pytest.raises(ConfigError, match="--tools must name at least one tool"):
        parse_args(["--tools", ","])


def _correction(cfg) -> tuple[str, dict]:
    """The run's off-policy correction and the keyword arguments it is called with."""
    from megarl.algorithms.slots import OFF_POLICY_CORRECTIONS

    name = cfg.algorithm.off_policy_correction
    return name, OFF_POLICY_CORRECTIONS.kwargs_of(cfg, name)


def test_off_policy_correction_flags(capsys):
    assert _correction(parse_args([])) == ("none", {})
    assert _correction(parse_args(["--tis-cap", "2"])) == ("tis", {"cap": 2.0})  # the older spelling turns tis on
    assert capsys.readouterr().err == ""
    # decoupled, the former name of tis (the same loss), becomes tis at its own cap, and says the new spelling once
    cfg = parse_args(["--off-policy-correction", "decoupled"])
    assert (_correction(cfg), cfg.components["off_policy_correction.tis"].tis_cap) == (("tis", {"cap": 5.0}), 5.0)
    assert _correction(parse_args(["--off-policy-correction", "decoupled", "--decoupled-is-cap", "3"])) == \
        ("tis", {"cap": 3.0})
    assert capsys.readouterr().err.splitlines() == [
        "megarl: note: --off-policy-correction decoupled is now spelled --off-policy-correction tis --tis-cap 5 "
        "(the same loss)",
        "megarl: note: --off-policy-correction decoupled is now spelled --off-policy-correction tis --tis-cap 3 "
        "(the same loss)"]


def test_older_spellings_are_resolved_once_so_the_resolved_config_reads_back_unchanged(tmp_path, capsys):
    import json

    from megarl.arguments import components
    from megarl.config import build_config, saved_config

    # A config.json saved by a run that said decoupled (before the rename) still loads, as tis at its cap.
    old = tmp_path / "old" / "config.json"
    old.parent.mkdir()
    saved = saved_config(parse_args([]))
    saved["config"]["algorithm"]["off_policy_correction"] = "decoupled"
    saved["config"]["off_policy_correction.tis"]["decoupled_is_cap"] = 4.0
    old.write_text(json.dumps(saved))
    assert _correction(parse_args([str(old)])) == ("tis", {"cap": 4.0})
    assert "decoupled is now spelled --off-policy-correction tis --tis-cap 4" in capsys.readouterr().err
    # What a run saves is the resolved spelling: it reads back as the same settings, with no note.
    for argv in (["--tis-cap", "2"], ["--off-policy-correction", "decoupled", "--decoupled-is-cap", "3"]):
        cfg = parse_args(argv)
        capsys.readouterr()
        path = tmp_path / "config.json"
        path.write_text(json.dumps(saved_config(cfg)))
        again = parse_args([str(path)])
        assert again == cfg and capsys.readouterr().err == ""
        assert dataclasses.replace(cfg.algorithm) == cfg.algorithm
    assert build_config({"tis_cap": 2.0}, components()).algorithm.off_policy_correction == "tis"


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--off-policy-correction", "async"],
         r"command line: --off-policy-correction 'async' is not registered; choose one of: geo_rs, icepop, mis, "
         r"none, seq_tis, tis \(--plugins"),
        (["--off-policy-correction", "tis"], r"--off-policy-correction tis needs --tis-cap > 0"),
        (["--off-policy-correction", "decoupled", "--tis-cap", "2"],
         r"--tis-cap 2.0 is the cap of --off-policy-correction tis; decoupled takes --decoupled-is-cap"),
        (["--off-policy-correction", "decoupled", "--decoupled-is-cap", "0"], r"--decoupled-is-cap must be > 0, got 0"),
    ],
)
def test_off_policy_correction_errors_name_the_flag(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_args(argv)


def test_every_moved_flag_keeps_its_spelling_and_lives_in_its_component_section():
    """The flags that belonged to one registered component each are that component's options now; `--help` lists
    them under its name."""
    from megarl.arguments import components
    from megarl.config import flag_specs

    specs = flag_specs(components())
    moved = {
        "rollout_function.tool_use": ["tool-parser", "tools", "max-turns", "max-tool-calls", "max-tool-output-tokens",
                                      "tool-response-format", "tool-timeout", "tool-memory-mb", "tool-output-bytes",
                                      "tool-workers", "tool-call-cost", "tool-format-bonus", "tool-calls-fail"],
        "off_policy_correction.tis": ["tis-cap", "decoupled-is-cap"],
        "off_policy_correction.seq_tis": ["seq-tis-cap"],
        "off_policy_correction.mis": ["mis-level", "mis-low", "mis-high"],
        "off_policy_correction.geo_rs": ["geo-rs-low", "geo-rs-high"],
        "off_policy_correction.icepop": ["icepop-low", "icepop-high"],
        "advantage_estimator.gae": ["gae-gamma", "gae-lambda", "gae-whiten", "value-clip"],
        "policy_loss.dual_clip": ["clip-ratio-c"],
        "rollout_backend.builtin": ["rollout-device", "rollout-threads"],
        "rollout_backend.sglang": ["sglang-mem-fraction", "sglang-tp-size", "weight-sync-port"],
    }
    added = {"rollout_function.tool_use": ["openenv", "openenv-url", "openenv-tool", "openenv-timeout"]}  # since
    now = {section: flags + added.get(section, []) for section, flags in moved.items()}
    assert {section: [s.flag[2:] for s in specs.values() if s.section == section] for section in moved} == now
    assert sum(map(len, moved.values())) == 33
    text = help_text()
    for section, flags in now.items():
        lines = text.split(f"\n{section}:\n", 1)[1].splitlines()
        block = lines[:next(i for i, line in enumerate(lines + ["end"]) if not line.startswith("  "))]
        assert [line.split()[0] for line in block] == [f"--{f}" for f in flags], section


# Settings added since those configs were saved (their defaults fill them in): tool_use's OpenEnv options, the
# engine launch timeout, the reward-hacking signals, the engine health options, the teacher's, --offload-frozen.
ADDED_SINCE = {"openenv", "openenv_url", "openenv_tool", "openenv_timeout", "engine_launch_timeout_seconds",
               "code_signals", "math_signals", "hack_alarm", "hack_window", "stop_on_hacking", "log_hack_samples",
               "engine_health_timeout", "engine_max_restarts", "teacher", "distill_coef", "distill_only",
               "offload_frozen", "distill_topk"}


@pytest.mark.parametrize("run", ["tool_use", "ppo"])
def test_a_config_json_saved_before_the_options_moved_loads_with_every_value(run):
    """tests/assets/saved_configs/*.json were written by 7eee737, when these flags were megarl's own sections
    (`tools`, `algorithm`, `rollout`): each setting reads back by its name, in whatever section owns it now."""
    import json

    path = REPO / "tests/assets/saved_configs" / f"{run}.json"
    saved = json.loads(path.read_text())["config"]
    cfg = parse_args([str(path)], check_registries=False)
    added = {"rollout_function.verifiers"}  # components registered after 7eee737: their options are new
    now = {name: value for key, section in cfg.to_dict().items() if key not in added
           for name, value in section.items()}
    then = {name: value for section in saved.values() for name, value in section.items()}
    assert {name: now.get(name, "absent") for name in then} == then
    assert set(now) - set(then) == ADDED_SINCE  # and nothing else new appeared
    assert now["engine_launch_timeout_seconds"] == 1800.0  # read back at its default
    assert "tools" in saved and "tools" not in cfg.to_dict()
    checked = parse_args([str(path)])
    assert checked == cfg


def test_a_moved_setting_read_from_its_old_section_names_its_new_home():
    """Code written before the settings moved to their components (a plugin reading cfg.algorithm.gae_gamma) fails
    naming where the setting is now; cfg.tools still gives the tool_use options, with a warning."""
    import warnings

    from megarl.arguments import parse_args

    cfg = parse_args(["recipes/tiny_cpu_tool.sh", "--gae-gamma", "0.9", "--max-turns", "3"], check_registries=False)
    with pytest.raises(AttributeError, match=r"cfg.components\['advantage_estimator.gae'\].gae_gamma .*--gae-gamma"):
        _ = cfg.algorithm.gae_gamma
    with pytest.raises(AttributeError, match=r"rollout_backend.sglang"):
        _ = cfg.rollout.sglang_tp_size
    assert cfg.components["advantage_estimator.gae"].gae_gamma == 0.9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cfg.tools.max_turns == 3
    assert "rollout_function.tool_use" in str(caught[0].message)


def test_build_config_refuses_a_setting_no_section_declares():
    """A component's option given without the components' options dataclasses would be dropped in silence."""
    from megarl.config import build_config

    with pytest.raises(ConfigError, match="gae_gamma belong to no section"):
        build_config({"gae_gamma": 0.5})
