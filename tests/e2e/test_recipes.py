"""Every shipped recipe trains 2 steps on CPU, and a recipe broken on purpose fails its smoke run, naming the problem.

How a smoke run departs from its recipe, the one way (environment variables for the recipe's own paths, then
`recipe_smoke.overrides`: device, backend and sizes only), is `tests/recipe_smoke.py`'s docstring and
docs/guide.md, "Recipe smoke runs". All the runs, the good and the broken, share one process (torch and Megatron
imported once); r1_code's `code` verifier and the tool demo run programs in the local sandbox, so conftest.py gives
this file to the worker that runs the other sandbox tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, env
from recipe_smoke import DEFAULT_MODEL, RUNS, overrides

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.sh"))

# A copy of a recipe broken on purpose: (recipe, text replaced in the copy or None to append, the new text, what
# the failure must say). A misspelled flag in every recipe; a data key the rows lack and an unregistered verifier
# in the math recipe.
BROKEN = {
    **{f"misspelled-flag-{r}": (r, None, "ALGORITHM_ARGS+=(--kl-coeff 0)\n",
                                "unknown flag --kl-coeff; did you mean --kl-coef") for r in RECIPES},
    "missing-data-key-r1_math": ("r1_math", None, "DATA_ARGS+=(--input-key question)\n",
                                 "train.jsonl:1: missing field 'question' (fields: prompt, answer, verifier, source)"),
    "unregistered-verifier-r1_math": ("r1_math", "--default-verifier math", "--default-verifier nosuch",
                                      "--default-verifier 'nosuch' is not registered; choose one of: "),
}


def _broken_copy(root: Path, case: str) -> Path:
    """recipes/ under `root`, every file a link to the shipped one but the broken copy (recipes find their model
    files and the recipes they source through their own directory)."""
    recipe, old, new, _ = BROKEN[case]
    recipes = root / case / "recipes"
    recipes.mkdir(parents=True)
    for p in (REPO / "recipes").iterdir():
        (recipes / p.name).symlink_to(p)
    text = (REPO / "recipes" / f"{recipe}.sh").read_text()
    if old is None:
        text += new
    else:
        assert text.count(old) == 1, f"the break of {case} needs {old!r} once in the recipe"
        text = text.replace(old, new)
    copy = recipes / f"{recipe}.sh"
    copy.unlink()
    copy.write_text(text)
    return copy


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Every run of RUNS and every broken copy, in one `tests/recipe_smoke.py` process: {run: (result, out dir)}."""
    root = tmp_path_factory.mktemp("recipes")
    broken = [str(_broken_copy(root / "broken", case)) for case in BROKEN]
    runs = [*broken, *RUNS]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "recipe_smoke.py"), "--out", str(root / "runs"),
                           *runs], cwd=REPO, env=env(), capture_output=True, text=True, timeout=540)
    results = [json.loads(line) for line in (root / "runs" / "results.jsonl").read_text().splitlines()]
    assert [r["run"] for r in results] == runs, proc.stderr[-3000:]
    by_run = {r["run"]: (r, Path(r["out"])) for r in results}
    return {**{case: by_run[b] for case, b in zip(BROKEN, broken)}, **{r: by_run[r] for r in RUNS}}


def _differing(a: dict, b: dict) -> set[str]:
    """The settings (section.field) whose values differ between two saved configs' "config" objects."""
    return {f"{s}.{k}" for s in a.keys() | b.keys() for k in a.get(s, {}).keys() | b.get(s, {}).keys()
            if a.get(s, {}).get(k) != b.get(s, {}).get(k)}


def _overridden() -> set[str]:
    """section.field of every flag `overrides` names."""
    from megarl import config
    from megarl.arguments import components

    specs = config.flag_specs(components())
    flags = [f for f in overrides(Path("out")) if f.startswith("--")]
    return {f"{spec.section}.{spec.name}" for f in flags
            for spec in [specs.get(f) or specs[f.replace("--no-", "--", 1)]]}


def check_smoke(result: dict, out: Path) -> None:
    """What a smoke run must show: a clean exit, 2 logged steps with finite losses, and the recipe's own settings
    everywhere but where `overrides` changes them."""
    assert result["rc"] == 0, f"{result['run']} failed:\n{result['stderr']}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in rows), rows
    ran = json.loads((out / "config.json").read_text())["config"]
    assert result["recipe_config"] is not None
    changed = _differing(ran, result["recipe_config"])
    assert changed <= _overridden(), f"settings changed beyond the overrides: {sorted(changed - _overridden())}"


@pytest.mark.parametrize("run", RUNS)
def test_recipe_trains_two_steps_on_cpu(smoke_runs, run):
    if run == "tiny_cpu_rg":
        pytest.importorskip("reasoning_gym", reason="the reasoning-gym demo needs the rg extra: pip install megarl[rg]")
    check_smoke(*smoke_runs[run])


@pytest.mark.parametrize("case", BROKEN)
def test_a_recipe_broken_on_purpose_fails_its_smoke_run(smoke_runs, case):
    result, out = smoke_runs[case]
    with pytest.raises(AssertionError):
        check_smoke(result, out)
    assert result["rc"] == 2 and "Traceback" not in result["stderr"], result["stderr"]  # a ConfigError, said once
    assert BROKEN[case][3] in result["stderr"], result["stderr"]
    assert not (out / "metrics.jsonl").exists(), "it must stop before training: while parsing or loading the data"


def test_overrides_leave_verifier_reward_and_algorithm_alone():
    """The smoke runs change the device, the backend, the sizes and the paths: never a setting that decides what is
    rewarded or how the model learns from it."""
    allowed = {"model.transformer_impl", "model.bf16", "model.sequence_parallel", "model.tensor_model_parallel_size",
               "model.pipeline_model_parallel_size", "model.expert_model_parallel_size",
               "model.expert_tensor_parallel_size", "rollout.rollout_backend", "rollout.max_response_len",
               "training.num_steps", "data.rollout_batch_size", "logging.output_dir", "checkpoint.save"}
    assert _overridden() == allowed


def test_every_recipe_and_model_file_has_a_smoke_run():
    """A new recipe or model file needs a line in RUNS (tests/recipe_smoke.py)."""
    recipes = {r.split(":")[0] for r in RUNS}
    models = {r.split(":")[1] for r in RUNS if ":" in r} | set(DEFAULT_MODEL.values())
    sourced = {m.stem for r in recipes for m in (REPO / "recipes" / "models").glob("*.sh")
               if f"recipes/models/{m.name}" in (REPO / "recipes" / f"{r}.sh").read_text()}
    assert recipes == set(RECIPES)
    assert models | sourced == {p.stem for p in (REPO / "recipes" / "models").glob("*.sh")}
