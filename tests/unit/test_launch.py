"""The Slurm and nemo-run launchers: rendered, syntax-checked, dry-run, and held against the recipe's TP x PP x DP.

The sbatch scripts also run for real against stand-in `srun` / `scontrol` commands, to check what they do on
success, on a crash, on a config error, and when Slurm warns that the time limit is near.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest

from helpers import REPO, env

from launch import render
from launch.resume import resume_args
from megarl.arguments import parse_args

RECIPE = str(REPO / "recipes/r1_math.sh")  # TP=2, PP=1, 128 prompts per step


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("MODEL_DIR", "DATA_DIR", "RECIPE_MODEL", "CKPT_DIR", "OUTPUT_DIR", "CONTAINER_IMAGE", "LOG_DIR"):
        monkeypatch.delenv(var, raising=False)


def bash_n(text: str, tmp_path, name: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def commands(stdout: str) -> list[list[str]]:
    """The srun command lines of a dry run, split as bash would split them."""
    return [shlex.split(line.rstrip(" &")) for line in stdout.splitlines() if line.startswith("srun ")]


def option(cmd: list[str], name: str) -> str:
    for i, w in enumerate(cmd):
        if w == name:
            return cmd[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    raise AssertionError(f"{name} not in {cmd}")


def world_of(torchrun_cmd: list[str]) -> int:
    return int(option(torchrun_cmd, "--nnodes")) * int(option(torchrun_cmd, "--nproc-per-node"))


def recipe_argv_of(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("launch/resume.py") + 1:]


def test_colocated_2x8_renders_and_matches_the_recipe(tmp_path):
    script = render.render("colocated", render.sbatch_header(nodes=2, gpus_per_node=8, account="acct",
                                                             partition="batch", time="02:00:00"))
    bash_n(script, tmp_path, "colocated.sbatch")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --account=acct", "#SBATCH --requeue",
                 "#SBATCH --partition=batch", "#SBATCH --time=02:00:00", "#SBATCH --signal=B:USR1@300"):
        assert line in script.splitlines()
    proc = render.dry_run(script, [RECIPE, "--num-steps", "7"], nodes=2, env={"CKPT_DIR": "/ckpt/run1",
                                                                              "CONTAINER_IMAGE": "nvcr.io/x:1"})
    assert proc.returncode == 0, proc.stderr
    assert "TP=2 x PP=1 x DP=8 = 16 GPUs" in proc.stdout
    [cmd] = commands(proc.stdout)
    bash_n(shlex.join(cmd), tmp_path, "cmd.sh")
    assert option(cmd, "--nodes") == "2" and option(cmd, "--nodelist") == "node001,node002"
    assert option(cmd, "--container-image") == "nvcr.io/x:1"
    torchrun = cmd[cmd.index("torchrun"):]
    assert world_of(torchrun) == 16
    assert option(torchrun, "--rdzv-endpoint") == "node001:29500" and option(torchrun, "--rdzv-backend") == "c10d"
    cfg = parse_args(recipe_argv_of(torchrun))
    tp, pp = cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size
    assert tp * pp * render.check_parallel(cfg, 16).dp == world_of(torchrun)
    assert cfg.checkpoint.save == "/ckpt/run1" and cfg.training.num_steps == 7


def test_disaggregated_splits_training_and_server_nodes(tmp_path):
    script = render.render("disaggregated", render.sbatch_header(nodes=3))
    bash_n(script, tmp_path, "disaggregated.sbatch")
    proc = render.dry_run(script, [RECIPE], nodes=3, env={"ROLLOUT_NODES": "1", "SGLANG_TP": "2"})
    assert proc.returncode == 0, proc.stderr
    server, train = commands(proc.stdout)
    assert option(server, "--nodelist") == "node003" and option(server, "--ntasks-per-node") == "4"
    assert option(server, "--tp-size") == "2" and option(server, "--model-path") == "/models/Qwen2.5-Math-1.5B"
    # Each of the node's 4 tasks serves its own pair of GPUs on its own port: run the task's command as task 3.
    task = server[server.index("bash"):]
    task[task.index("python")] = "echo"
    out = subprocess.run(task, env={**os.environ, "SLURM_LOCALID": "3"}, capture_output=True, text=True).stdout
    assert out.split()[-4:] == ["--base-gpu-id", "6", "--port", "30003"]
    assert option(train, "--nodelist") == "node001,node002"
    torchrun = train[train.index("torchrun"):]
    assert world_of(torchrun) == 16  # the training nodes only
    cfg = parse_args(recipe_argv_of(torchrun))
    assert cfg.rollout.rollout_servers == ",".join(f"node003:{30000 + i}" for i in range(4))
    assert cfg.components["rollout_backend.sglang"].sglang_tp_size == 2
    assert render.check_parallel(cfg, 16).dp == 8


@pytest.mark.parametrize("flags,env,seed,deterministic", [
    ([], {}, "42", True),  # the recipe's --seed 42
    (["--seed", "7"], {"SGLANG_DETERMINISTIC": "0"}, "7", False),
])
def test_disaggregated_servers_run_deterministic_inference_with_the_recipe_seed(flags, env, seed, deterministic):
    """SGLang ignores a request's sampling_seed unless the server runs with --enable-deterministic-inference, which
    megarl's in-process engine turns on whenever it is seeded (SGLangEngine.launch; every run is, --seed defaults to
    1234): the servers the script starts must do the same, with the trainer's seed as their --random-seed."""
    script = render.render("disaggregated", render.sbatch_header(nodes=2))
    proc = render.dry_run(script, [RECIPE, *flags], nodes=2, env={"ROLLOUT_NODES": "1", **env})
    assert proc.returncode == 0, proc.stderr
    server, train = commands(proc.stdout)
    launched = server[server.index("sglang.launch_server"):]
    assert str(parse_args(recipe_argv_of(train[train.index("torchrun"):])).training.seed) == seed
    if deterministic:
        assert "--enable-deterministic-inference" in launched and option(launched, "--random-seed") == seed
    else:
        assert "--enable-deterministic-inference" not in launched and "--random-seed" not in launched


def test_disaggregated_refuses_an_unknown_sglang_deterministic_value():
    script = render.render("disaggregated", render.sbatch_header(nodes=2))
    proc = render.dry_run(script, [RECIPE], nodes=2, env={"ROLLOUT_NODES": "1", "SGLANG_DETERMINISTIC": "yes"})
    assert proc.returncode == 2 and "SGLANG_DETERMINISTIC=yes; allowed: 1 (default) or 0" in proc.stderr


@pytest.mark.parametrize("staleness", [0, 1])
def test_disaggregated_dry_run_shows_the_synchronous_or_asynchronous_layout(staleness):
    script = render.render("disaggregated", render.sbatch_header(nodes=3))
    flags = ["--async-staleness", str(staleness)] if staleness else []
    proc = render.dry_run(script, [RECIPE, *flags], nodes=3, env={"ROLLOUT_NODES": "1", "SGLANG_TP": "2"})
    assert proc.returncode == 0, proc.stderr
    if staleness:
        assert ("megarl: asynchronous (--async-staleness 1): 4 SGLang server(s) on 1 node(s) generate step s's batch "
                "with the weights of step s - 1 while 2 training node(s) train") in proc.stdout
    else:
        assert ("megarl: synchronous: 4 SGLang server(s) on 1 node(s) generate, then 2 training node(s) train"
                in proc.stdout)
    _, train = commands(proc.stdout)
    cfg = parse_args(recipe_argv_of(train[train.index("torchrun"):]))
    assert cfg.training.async_staleness == staleness


@pytest.mark.parametrize("kind,nodes,flags,message", [
    ("colocated", 3, ["--tensor-model-parallel-size", "16"], "not divisible by --tensor-model-parallel-size 16"),
    ("colocated", 3, ["--tensor-model-parallel-size", "4"], "--rollout-batch-size 128 is not divisible"),
    ("disaggregated", 2, ["--rollout-backend", "builtin"], "--rollout-servers needs --rollout-backend sglang"),
])
def test_a_launch_that_does_not_fit_the_recipe_starts_nothing(kind, nodes, flags, message):
    proc = render.dry_run(render.render(kind, render.sbatch_header(nodes=nodes)), [RECIPE, *flags], nodes=nodes)
    assert proc.returncode == 2
    assert message in proc.stderr and "nothing was started" in proc.stderr
    assert not commands(proc.stdout)


def test_render_cli_prints_script_and_commands(capsys, tmp_path):
    out = tmp_path / "job.sbatch"
    assert render.main(["colocated", "--nodes", "2", "--out", str(out), RECIPE, "--", "--num-steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in text and "torchrun --nnodes 2 --nproc-per-node 8" in text
    assert out.read_text().startswith("#!/bin/bash") and f"sbatch {out}" in text


def test_resume_adds_load_only_when_a_complete_checkpoint_exists(tmp_path):
    argv = [RECIPE, "--save", str(tmp_path)]
    assert resume_args(argv) == argv  # a first start
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "latest").write_text("iter_0000020")
    assert resume_args(argv) == [*argv, "--load", str(tmp_path)]
    explicit = [*argv, "--load", "/elsewhere"]
    assert resume_args(explicit) == explicit


# ------------------------------------------------------------------------- the scripts against a stand-in Slurm

def fake_slurm(tmp_path, srun_body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> "{tmp_path}/calls"\n{srun_body}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> "{tmp_path}/calls"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", MEGARL_ROOT=str(REPO), MEGARL_PYTHON=sys.executable,
               MEGARL_HOSTS="gpu1 gpu2", SLURM_JOB_ID="77", SLURM_GPUS_ON_NODE="8", LOG_DIR=str(tmp_path / "logs"))
    return env


def run_script(env, *args, timeout=60):
    return subprocess.run(["bash", str(REPO / "launch/slurm/colocated.sbatch"), RECIPE, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def calls(tmp_path) -> list[str]:
    f = tmp_path / "calls"
    return f.read_text().splitlines() if f.exists() else []


@pytest.mark.parametrize("rc,requeued", [(0, False), (1, True), (2, False)])
def test_sbatch_requeues_a_crash_but_not_success_or_a_config_error(tmp_path, rc, requeued):
    proc = run_script(fake_slurm(tmp_path, f"exit {rc}"))
    assert [c for c in calls(tmp_path) if c.startswith("srun")][0].count("torchrun") == 1
    assert any(c == "scontrol requeue 77" for c in calls(tmp_path)) == requeued, proc.stdout + proc.stderr


def test_sbatch_gives_up_after_max_failures(tmp_path):
    env = fake_slurm(tmp_path, "exit 1")
    env["MAX_FAILURES"] = "2"
    rcs = [run_script(env).returncode for _ in range(3)]
    assert calls(tmp_path).count("scontrol requeue 77") == 2 and rcs[-1] == 1


@pytest.mark.slow
def test_sbatch_requeues_when_the_time_limit_is_near(tmp_path):
    env = fake_slurm(tmp_path, "sleep 3")
    proc = subprocess.Popen(["bash", str(REPO / "launch/slurm/colocated.sbatch"), RECIPE], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not any(c.startswith("srun") for c in calls(tmp_path)) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@300` sends to the batch shell
    out, err = proc.communicate(timeout=30)
    assert "scontrol requeue 77" in calls(tmp_path), out + err
    assert "time limit near" in out


# ------------------------------------------------------------------------------------------------- nemo-run

def test_nemo_run_absent_is_reported_clearly(monkeypatch):
    from launch import nemo_run_launcher as nr

    monkeypatch.setitem(sys.modules, "nemo_run", None)
    with pytest.raises(render.LaunchError, match=r"nemo-run is not installed: pip install"):
        nr.task([RECIPE])


@pytest.fixture
def nemo(tmp_path, monkeypatch):
    pytest.importorskip("nemo_run", reason="nemo-run is an optional extra: pip install -e '.[nemo-run]'")
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemo_home"))
    from launch import nemo_run_launcher as nr

    return nr


def test_nemo_run_slurm_dryrun_2x8(nemo, tmp_path):
    argv = nemo.recipe_argv(RECIPE, ["--num-steps", "5"], ckpt_dir="/ckpt/n")
    assert nemo.check(argv, 16).dp == 8
    ex = nemo.slurm_executor(nodes=2, gpus_per_node=8, account="acct", partition="batch",
                             container_image="nvcr.io/x:1", job_dir=str(tmp_path / "jobs"))
    script = nemo.dryrun(nemo.task(argv), ex)
    bash_n(script, tmp_path, "nemo.sbatch")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "TORCHX_MAX_RETRIES=3" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    [line] = [ln for ln in script.splitlines() if ln.startswith("srun ") and "torchrun" in ln]
    cmd = line.split()
    torchrun = cmd[cmd.index("torchrun"):]
    assert world_of(torchrun) == 16
    assert cmd[cmd.index(str(REPO / "launch/resume.py")) + 1:] == argv


def test_nemo_run_slurm_dryrun_paths_without_a_container(nemo, tmp_path, capsys):
    """The CLI's own dry run, as a user runs it: every path of the script is the job directory's, once."""
    job_dir = tmp_path / "logs" / "nemo-run"
    assert nemo.main(["slurm", "--nodes", "2", "--account", "A", "--job-dir", str(job_dir), "--dryrun", RECIPE]) == 0
    script = capsys.readouterr().out
    [output] = [ln.split("=", 1)[1] for ln in script.splitlines() if ln.startswith("#SBATCH --output=")]
    [srun] = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    words = srun.split()
    chdir = words[words.index("--chdir") + 1]
    task_dir = Path(chdir).parent
    assert task_dir.parent.parent.parent == job_dir and task_dir.name == "train"  # <job-dir>/megarl/<id>/train
    assert output == f"{task_dir}/sbatch_megarl-train_%j.out" and chdir == f"{task_dir}/code"
    assert words[words.index("--output") + 1].startswith(f"{task_dir}/log-megarl-train_")
    assert script.count(str(job_dir)) == script.count(str(task_dir)), "no path outside the job's own directory"


def test_nemo_run_refuses_paths_it_would_rewrite(nemo, tmp_path, capsys):
    job_dir = tmp_path / "nemo_run"
    assert nemo.main(["slurm", "--nodes", "2", "--job-dir", str(job_dir), "--dryrun", RECIPE]) == 2
    assert "rewrites every '/nemo_run'" in capsys.readouterr().err


def test_nemo_run_local_dryrun(nemo):
    argv = nemo.recipe_argv(str(REPO / "recipes/tiny_cpu.sh"), [])
    text = nemo.dryrun(nemo.task(argv), nemo.local_executor(gpus=2))
    assert "torchrun" in text and "--nproc-per-node 2" in text and str(REPO / "launch/resume.py") in text


@pytest.mark.parametrize("script", ["launch/nemo_run_launcher.py", "launch/nemo_run.py"])
def test_nemo_run_launcher_runs_as_a_script_and_the_old_name_still_works(tmp_path, script):
    """As a script, launch/ is first on sys.path: the launcher must still get the nemo_run package, not the file that
    keeps its old command (launch/nemo_run.py), which says where the launcher went and runs it."""
    pytest.importorskip("nemo_run", reason="nemo-run is an optional extra: pip install -e '.[nemo-run]'")
    proc = subprocess.run([sys.executable, script, "local", "--gpus", "2", "--dryrun",
                           str(REPO / "recipes/tiny_cpu.sh")], cwd=REPO, env={**env(), "NEMORUN_HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchrun" in proc.stdout and str(REPO / "launch/resume.py") in proc.stdout
    note = "note: launch/nemo_run.py is now launch/nemo_run_launcher.py; running it"
    assert (proc.stderr.splitlines()[0] == note) == (script == "launch/nemo_run.py")


def test_nemo_run_cli_rejects_a_bad_layout_before_importing_nemo_run(capsys):
    from launch import nemo_run_launcher as nr

    assert nr.main(["slurm", "--nodes", "1", "--gpus-per-node", "3", "--dryrun", RECIPE]) == 2
    assert "not divisible by --tensor-model-parallel-size 2" in capsys.readouterr().err


# ------------------------------------------------------------------------- the shipped recipes and model files

MODELS = sorted(p.stem for p in (REPO / "recipes/models").glob("*.sh") if "MODEL_SHAPE" in p.read_text())


@pytest.mark.parametrize("recipe", ["r1_math", "r1_code"])
@pytest.mark.parametrize("model", MODELS)
def test_real_recipes_fit_their_launches(monkeypatch, recipe, model):
    """Each GPU recipe with each real model file: TP within a node and dividing the heads, and a whole number of
    replicas on 2 nodes x 8 GPUs (on two replicas' worth of GPUs for a model larger than that)."""
    from megarl.cli.plan import shape_from_bash

    monkeypatch.setenv("RECIPE_MODEL", model)
    cfg = parse_args([str(REPO / f"recipes/{recipe}.sh")])
    shape = shape_from_bash(REPO / f"recipes/models/{model}.sh")
    tp, pp = cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size
    assert tp <= 8 and shape.num_attention_heads % tp == 0 and shape.num_kv_heads % min(tp, shape.num_kv_heads) == 0
    assert shape.num_layers % pp == 0
    world = max(16, 2 * tp * pp)
    layout = render.check_parallel(cfg, world)
    assert layout.tp * layout.pp * layout.dp == world
