"""Run megarl/train.py, resuming from the newest complete checkpoint when the run has one.

    torchrun ... launch/resume.py recipes/<recipe>.sh [--flag value ...]

The launchers start every (re)queued job with this same command: when the run's `--save` directory already holds
a complete checkpoint (its `latest` file) and no `--load` was given, `--load <save dir>` is added, so a job that
Slurm requeued after a preemption or a time limit continues from where it was, and a first start begins afresh.
Every rank decides alike: nothing writes a checkpoint before training has loaded one.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def resume_args(argv: list[str]) -> list[str]:
    """`argv` plus `--load <save dir>` when that directory holds a complete checkpoint and no --load is set."""
    from megarl.arguments import parse_args

    cfg = parse_args(argv, check_registries=False)  # only the paths are read; train.py checks the rest
    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    if load or not save or not (Path(save) / "latest").is_file():
        return list(argv)
    return [*argv, "--load", save]


def main() -> None:
    from megarl.errors import ConfigError

    try:
        argv = resume_args(sys.argv[1:])
    except ConfigError:  # train.py reports a bad config itself, with its own exit code
        argv = sys.argv[1:]
    if argv != sys.argv[1:] and os.environ.get("RANK", "0") == "0":
        print(f"megarl: {argv[-1]}/latest exists: resuming from it", flush=True)
    sys.argv = [str(ROOT / "megarl" / "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
