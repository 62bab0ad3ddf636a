"""Where a run's checkpoints are on disk, for the code that writes them (`megarl.mcore.checkpoint`) and the code
that checks them before any work (`megarl.preflight`, `megarl-convert-checkpoint`): standard library only.

`<dir>/iter_0000007/` holds one complete checkpoint (an interrupted save is `iter_0000007.tmp`); `<dir>/latest`
names the newest complete one. Each checkpoint, and each run's output directory, holds the run's settings as
`config.json` (`SAVED_CONFIG`; written and read by `megarl.config.saved`).
"""

from __future__ import annotations

from pathlib import Path

from megarl.errors import ConfigError

LATEST = "latest"  # <dir>/latest names the newest complete iter_N directory
SAVED_CONFIG = "config.json"  # the run's settings, in each checkpoint and in the output directory


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def complete_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under `root` (an interrupted save is `iter_N.tmp`)."""
    steps = []
    for p in root.glob("iter_*"):
        if p.is_dir() and p.name[5:].isdigit():
            steps.append(int(p.name[5:]))
    return sorted(steps)


def resolve_load(load: str, ckpt_step: int = -1) -> Path | None:
    """The checkpoint `--load` resumes from: `load` itself when it is an iter_N directory, else its iter_N for
    --ckpt-step, else the one its `latest` names; None when it holds no checkpoint yet (a fresh start, as in
    Megatron and slime). A `latest` that names a missing directory, or a --ckpt-step with no checkpoint, is an
    error: something was lost, and starting afresh would hide it."""
    root = Path(load)
    if (root / "trainer_state.pkl").is_file():  # an iter_N directory itself
        if ckpt_step >= 0:
            raise ConfigError(f"--ckpt-step {ckpt_step}: --load {load} is already one step's checkpoint")
        return root
    if ckpt_step >= 0:
        path = root / iter_name(ckpt_step)
        if not path.is_dir():
            have = complete_steps(root) if root.is_dir() else []
            raise ConfigError(f"--ckpt-step {ckpt_step}: no {path.name} under --load {load} (complete steps there: "
                              f"{', '.join(map(str, have)) or 'none'})")
        return path
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    if not path.is_dir():
        raise ConfigError(f"--load {load}: '{LATEST}' names {path.name}, which does not exist")
    return path
