"""megarl launches through nemo-run: Slurm (`SlurmExecutor`) or this machine (`LocalExecutor`), both with
nemo-run's torchrun launcher. nemo-run is optional (`pip install -e .[nemo-run]`); launch/slurm/*.sbatch do the
same with nothing but Slurm.

    python launch/nemo_run_launcher.py slurm --nodes 2 --account A --partition P [--container-image IMG] \
        [--dryrun] recipes/r1_math.sh [-- --flag value ...]
    python launch/nemo_run_launcher.py local --gpus 2 [--dryrun] recipes/tiny_cpu.sh [-- --flag value ...]

`--dryrun` prints the sbatch script (or the local torchrun command) without contacting a cluster. Every start,
first or requeued, runs launch/resume.py, which resumes from the newest complete checkpoint under --save; on
Slurm a failed run is requeued up to --retries times (nemo-run's own requeue) and a preempted one by Slurm.
Paths are absolute: nemo-run's working directory is its job directory, not the checkout. (The file's name is not
nemo_run.py, which would shadow the nemo_run package for a script in this directory.)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from megarl.arguments import parse_args
from megarl.errors import ConfigError
from megarl.preflight import LaunchError, check_run

ROOT = Path(__file__).resolve().parents[1]

NOT_INSTALLED = ("nemo-run is not installed: pip install -e '.[nemo-run]' (or use launch/slurm/*.sbatch, which "
                 "need only Slurm)")


def _nemo_run():
    try:
        import nemo_run
    except ImportError:
        raise LaunchError(NOT_INSTALLED) from None
    return nemo_run


def recipe_argv(recipe: str, flags: list[str], ckpt_dir: str | None = None) -> list[str]:
    argv = [str(Path(recipe).resolve()), *flags]
    return [*argv, "--save", ckpt_dir] if ckpt_dir else argv


def check(argv: list[str], world_size: int):
    """The recipe against the GPUs asked for, as train.py's preflight checks it (`megarl.preflight`: the layout,
    the checkpoint's config.json when readable here, --load), before nemo-run is even imported."""
    return check_run(parse_args(argv, check_registries=False), world_size, required=False)[0]


def task(argv: list[str]):
    """`python launch/resume.py <recipe> [flags]`, which torchrun starts once per GPU."""
    return _nemo_run().Script(path=str(ROOT / "launch" / "resume.py"), args=list(argv), entrypoint="python")


# Without a container, nemo-run's Slurm script replaces every "/nemo_run" in its text with the job's directory
# (its in-container mount point, `nemo_run.config.RUNDIR_NAME`), so a path holding it comes out doubled.
_RUNDIR = "/nemo_run"


def check_paths(paths: list[str], container_image: str | None) -> None:
    """LaunchError for a path nemo-run's Slurm script would rewrite (see `_RUNDIR`)."""
    bad = [p for p in paths if _RUNDIR in str(p)]
    if bad and not container_image:
        raise LaunchError(f"nemo-run rewrites every '{_RUNDIR}' in its Slurm script to the job's directory, so these "
                          f"paths would be changed: {', '.join(map(str, bad))}; rename them (e.g. --job-dir "
                          "logs/nemo-run), or run in a container (--container-image)")


def slurm_executor(*, nodes: int, gpus_per_node: int = 8, account: str = "", partition: str | None = None,
                   time: str = "04:00:00", container_image: str | None = None, container_mounts: list[str] = (),
                   job_dir: str, retries: int = 3, env_vars: dict[str, str] | None = None):
    check_paths([job_dir, str(ROOT)], container_image)
    run = _nemo_run()
    mounts = [f"{ROOT}:{ROOT}", *container_mounts] if container_image else []
    return run.SlurmExecutor(
        account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus_per_node, gpus_per_node=gpus_per_node,
        time=time, exclusive=True, job_name_prefix="megarl-", container_image=container_image,
        container_mounts=mounts, retries=retries, launcher="torchrun",
        # The checkout is on the shared filesystem: the job's code/ directory is a link to it, not a copy.
        packager=run.Packager(symlink_from_remote_dir=str(ROOT)),
        tunnel=run.LocalTunnel(job_dir=job_dir), env_vars=dict(env_vars or {}),
    )


def local_executor(*, gpus: int, env_vars: dict[str, str] | None = None):
    run = _nemo_run()
    return run.LocalExecutor(ntasks_per_node=gpus, launcher="torchrun", env_vars=dict(env_vars or {}))


def dryrun(task, executor, name: str = "megarl") -> str:
    """What nemo-run would submit: the sbatch script for Slurm, the torchrun command line for a local run."""
    import shlex

    run = _nemo_run()
    with contextlib.redirect_stdout(sys.stderr):  # nemo-run's banners; stdout is the script alone
        with run.Experiment(name, log_level="WARN") as exp:
            exp.add(task, executor=executor, name="train")
            exp.dryrun(log=False)
            request = exp.jobs[0]._dryrun_info.request  # nemo-run keeps the dry run here; its log is rich text
    if hasattr(request, "materialize"):  # Slurm
        return request.materialize()
    lines = []
    for replicas in request.role_params.values():
        for r in replicas:
            lines.append(f"(cd {shlex.quote(r.cwd or str(ROOT))} && {shlex.join(r.args)})")
    return "\n".join(lines) + "\n"


def launch(task, executor, name: str = "megarl", detach: bool = True) -> None:
    run = _nemo_run()
    with run.Experiment(name) as exp:
        exp.add(task, executor=executor, name="train")
        exp.run(detach=detach)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="where", required=True)
    s = sub.add_parser("slurm", help="sbatch through nemo-run's SlurmExecutor (run it on the login node)")
    s.add_argument("--nodes", type=int, required=True)
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--account", default="")
    s.add_argument("--partition")
    s.add_argument("--time", default="04:00:00")
    s.add_argument("--container-image")
    s.add_argument("--container-mounts", default="", help="src:dst[,src:dst]; the checkout is always mounted")
    s.add_argument("--retries", type=int, default=3, help="requeues after a failure")
    s.add_argument("--job-dir", default=str(ROOT / "logs" / "nemo-run"), help="nemo-run's job and log directory")
    loc = sub.add_parser("local", help="torchrun on this machine through nemo-run's LocalExecutor")
    loc.add_argument("--gpus", type=int, required=True, help="processes (GPUs) on this machine")
    for q in (s, loc):
        q.add_argument("recipe")
        q.add_argument("--ckpt-dir", help="checkpoints here (--save); a restarted job resumes from them")
        q.add_argument("--name", default="megarl")
        q.add_argument("--dryrun", action="store_true", help="print what would be submitted; contact nothing")
    args = p.parse_args(own)
    run_argv = recipe_argv(args.recipe, flags, args.ckpt_dir)
    world = args.nodes * args.gpus_per_node if args.where == "slurm" else args.gpus
    try:
        layout = check(run_argv, world)
        cp = f" x CP={layout.cp}" if layout.cp > 1 else ""
        print(f"megarl: TP={layout.tp} x PP={layout.pp}{cp} x DP={layout.dp} = {world} GPUs", file=sys.stderr)
        if args.where == "slurm":
            check_paths(run_argv, args.container_image)
            mounts = [m for m in args.container_mounts.split(",") if m]
            executor = slurm_executor(nodes=args.nodes, gpus_per_node=args.gpus_per_node, account=args.account,
                                      partition=args.partition, time=args.time, container_image=args.container_image,
                                      container_mounts=mounts, job_dir=args.job_dir, retries=args.retries)
        else:
            executor = local_executor(gpus=args.gpus)
        if args.dryrun:  # writes nothing under --job-dir
            print(dryrun(task(run_argv), executor, args.name), end="")
        else:
            launch(task(run_argv), executor, args.name)
    except (ConfigError, LaunchError) as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
