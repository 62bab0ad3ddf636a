"""Fill in and dry-run the Slurm launchers in launch/slurm/, and check a recipe against the world size.

    python launch/render.py colocated --nodes 2 [--gpus-per-node 8] [--account A] [--partition P] [--time T]
        [--container-image IMG] [--ckpt-dir DIR] [--out job.sbatch] [--submit] recipes/r1_math.sh [-- --flag v ...]
    python launch/render.py disaggregated --nodes 3 --rollout-nodes 1 recipes/r1_math.sh
    python launch/render.py check --world-size 16 -- recipes/r1_math.sh [--flag v ...]   # used by the scripts

The rendered script is the sbatch file with its `#SBATCH` header filled in; the dry run executes that same file
with MEGARL_DRY_RUN=1, which prints every command it would run (shell-quoted) and starts nothing. Standard
library only, so the batch host needs no more than python3 and the checkout (launch/slurm/common.sh puts the
checkout on PYTHONPATH for it; elsewhere megarl comes from the install, `make venv`).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megarl.arguments import parse_args
from megarl.config import Config
from megarl.errors import ConfigError
from megarl.preflight import LaunchError, Layout, check_run, parallel_layout

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = ROOT / "launch" / "slurm"
KINDS = ("colocated", "disaggregated")


def check_parallel(cfg: Config, world_size: int) -> Layout:
    """TP x PP x CP x DP = world size, and the prompts split evenly over DP; else LaunchError naming the flags."""
    try:
        return parallel_layout(cfg, world_size)
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def check_main(world_size: int, recipe_argv: list[str]) -> int:
    """Print shell assignments for the sbatch scripts (HF_CHECKPOINT, TP, PP, DP, SAVE_DIR, ASYNC_STALENESS, SEED),
    or the error. The
    recipe is checked as train.py's preflight checks it (`megarl.preflight`): the layout, the checkpoint's
    config.json when this host can read it, --load."""
    try:
        cfg = parse_args(recipe_argv, check_registries=False)  # the batch host's python: standard library only
        layout, shape, _ = check_run(cfg, world_size, required=False)
    except (ConfigError, LaunchError) as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    if shape is None:
        print(f"megarl: note: {cfg.model.hf_checkpoint}/config.json is not readable on this host; the model is "
              "checked when the job starts", file=sys.stderr)
    values = {"HF_CHECKPOINT": cfg.model.hf_checkpoint, "TP": layout.tp, "PP": layout.pp, "CP": layout.cp,
              "DP": layout.dp, "SAVE_DIR": cfg.checkpoint.save, "ASYNC_STALENESS": cfg.training.async_staleness,
              "SEED": cfg.training.seed}
    for k, v in values.items():
        print(f"{k}={shlex.quote(str(v))}")
    return 0


def sbatch_header(*, nodes: int, gpus_per_node: int = 8, job_name: str | None = None,
                  time: str | None = None, account: str | None = None, partition: str | None = None,
                  log_dir: str | None = None) -> dict[str, str]:
    """The `#SBATCH` options to set (the rest of the file's header stays)."""
    opts = {"nodes": str(nodes), "gpus-per-node": str(gpus_per_node)}
    for key, value in (("job-name", job_name), ("time", time), ("account", account), ("partition", partition)):
        if value:
            opts[key] = value
    if log_dir:
        opts["output"] = f"{log_dir}/slurm-%x-%j.out"
    return opts


def render(kind: str, header: dict[str, str]) -> str:
    """launch/slurm/<kind>.sbatch with these `#SBATCH --key=value` lines replaced or added."""
    if kind not in KINDS:
        raise LaunchError(f"unknown launch {kind!r}; choose one of: {', '.join(KINDS)}")
    lines = (SLURM_DIR / f"{kind}.sbatch").read_text().splitlines()
    todo = dict(header)
    last = 0
    for i, line in enumerate(lines):
        m = re.match(r"#SBATCH --([\w-]+)", line)
        if m:
            last = i
            if m.group(1) in todo:
                lines[i] = f"#SBATCH --{m.group(1)}={todo.pop(m.group(1))}"
    lines[last + 1:last + 1] = [f"#SBATCH --{k}={v}" for k, v in todo.items()]
    return "\n".join(lines) + "\n"


def dry_run(script: str, recipe_argv: list[str], *, nodes: int, gpus_per_node: int = 8,
            env: dict[str, str] | None = None, job_id: str = "4242") -> subprocess.CompletedProcess:
    """Run a rendered script with MEGARL_DRY_RUN=1 and a made-up allocation; stdout holds the commands."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run_env.update({"MEGARL_DRY_RUN": "1", "MEGARL_ROOT": str(ROOT), "MEGARL_PYTHON": sys.executable,
                    "MEGARL_HOSTS": " ".join(f"node{i:03d}" for i in range(1, nodes + 1)),
                    "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "megarl", "SLURM_GPUS_ON_NODE": str(gpus_per_node)})
    run_env.update(env or {})
    return subprocess.run(["bash", "-c", script, "sbatch-script", *recipe_argv], capture_output=True, text=True,
                          env=run_env, cwd=ROOT, timeout=60)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    own, extra = _split(list(sys.argv[1:] if argv is None else argv))
    if own[:1] == ["check"]:
        p = argparse.ArgumentParser(prog="render.py check")
        p.add_argument("--world-size", type=int, required=True)
        args = p.parse_args(own[1:])
        return check_main(args.world_size, extra)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kind", choices=KINDS)
    p.add_argument("recipe", help="recipes/<r>.sh; flags for it go after --")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the job (training + rollout nodes)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--rollout-nodes", type=int, default=1, help="disaggregated: nodes that run SGLang servers")
    p.add_argument("--sglang-tp", type=int, default=1, help="disaggregated: tensor-parallel size of each server")
    p.add_argument("--job-name"), p.add_argument("--time"), p.add_argument("--account"), p.add_argument("--partition")
    p.add_argument("--container-image", help="run every step inside this image (pyxis)")
    p.add_argument("--container-mounts", help="extra mounts, src:dst[,src:dst]")
    p.add_argument("--ckpt-dir", help="checkpoints here (--save); requeued jobs resume from them")
    p.add_argument("--log-dir", help="Slurm and per-node logs here")
    p.add_argument("--out", help="write the rendered script here")
    p.add_argument("--submit", action="store_true", help="sbatch the rendered script (needs --out)")
    args = p.parse_args(own)
    header = sbatch_header(nodes=args.nodes, gpus_per_node=args.gpus_per_node, job_name=args.job_name,
                           time=args.time, account=args.account, partition=args.partition, log_dir=args.log_dir)
    script = render(args.kind, header)
    env = {k: v for k, v in (("CONTAINER_IMAGE", args.container_image), ("CONTAINER_MOUNTS", args.container_mounts),
                             ("CKPT_DIR", args.ckpt_dir), ("LOG_DIR", args.log_dir)) if v}
    if args.kind == "disaggregated":
        env.update(ROLLOUT_NODES=str(args.rollout_nodes), SGLANG_TP=str(args.sglang_tp))
    recipe_argv = [args.recipe, *extra]
    result = dry_run(script, recipe_argv, nodes=args.nodes, gpus_per_node=args.gpus_per_node, env=env)
    print(f"# ---- {args.kind}.sbatch as submitted ({args.nodes} nodes x {args.gpus_per_node} GPUs)")
    print(script, end="")
    print("# ---- dry run: what it runs (hosts are placeholders for the allocation's)")
    print(result.stdout, end="", flush=True)
    if result.returncode:
        print(result.stderr, end="", file=sys.stderr)
        return result.returncode
    if args.out:
        Path(args.out).write_text(script)
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        cmd = f"{exports + ' ' if exports else ''}sbatch {shlex.quote(args.out)} {shlex.join(recipe_argv)}"
        print(f"# ---- written to {args.out}; submit from the repository root with:\n{cmd}")
        if args.submit:
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            return subprocess.run(["bash", "-c", cmd], cwd=ROOT).returncode
    elif args.submit:
        raise SystemExit("--submit needs --out (the file sbatch submits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
