"""Where a run's checkpoints are on disk, for the code that writes them (`megarl.mcore.checkpoint`) and the code
that checks them before any work (`megarl.preflight`, `megarl-convert-checkpoint`): standard library only.

`<dir>/iter_0000007/` holds one complete checkpoint (an interrupted save is `iter_0000007.tmp`); `<dir>/latest`
names the newest complete one. Each checkpoint, and each run's output directory, holds the run's settings as
`config.json` (`SAVED_CONFIG`; written and read by `megarl.config.saved`).

A checkpoint is written under `iter_N.tmp`, given a manifest (`manifest.json`: every file's path and size, written
last) and made visible by one rename. Resuming checks the manifest: a checkpoint whose files are missing or of
another size (truncated, half copied) is named and skipped for the newest earlier one that is whole, never loaded.
Checkpoints saved before the manifest existed have none and are taken as complete, as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megarl.errors import ConfigError

LATEST = "latest"  # <dir>/latest names the newest complete iter_N directory
SAVED_CONFIG = "config.json"  # the run's settings, in each checkpoint and in the output directory
MANIFEST = "manifest.json"  # every file of a checkpoint with its size; written last, before the rename


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def complete_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under `root` (an interrupted save is `iter_N.tmp`)."""
    steps = []
    for p in root.glob("iter_*"):
        if p.is_dir() and p.name[5:].isdigit():
            steps.append(int(p.name[5:]))
    return sorted(steps)


def write_manifest(ckpt_dir: Path, step: int) -> None:
    """`manifest.json` in `ckpt_dir`: each file under it (relative path -> bytes), each flushed to disk first, so a
    checkpoint with a manifest is whole. Called by rank 0 once every rank has written its files."""
    files = {}
    for path in sorted(p for p in Path(ckpt_dir).rglob("*") if p.is_file()):
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        files[path.relative_to(ckpt_dir).as_posix()] = path.stat().st_size
    tmp = Path(ckpt_dir) / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": 1, "step": step, "files": files}, fh, indent=0)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, Path(ckpt_dir) / MANIFEST)


def problem(ckpt_dir: Path) -> str:
    """'' when `ckpt_dir` is a whole checkpoint, else what is wrong with it, in words. One without a manifest
    (saved before megarl wrote them) is whole when it holds its training state."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return "it does not exist"
    manifest = ckpt_dir / MANIFEST
    if not manifest.is_file():
        if (ckpt_dir / "trainer_state.pkl").is_file() or (ckpt_dir / "lora_base.json").is_file():
            return ""
        return f"it has no {MANIFEST} and no trainer_state.pkl (a save that did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name, size in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            return f"{name}, in its {MANIFEST}, is missing"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size} bytes, its {MANIFEST} says {size}"
    return ""


def find_resume(root: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint under `root` to resume from, and a line for each newer one that was skipped (a checkpoint that
    fails `problem`, an interrupted save `iter_N.tmp`). The one `latest` names when it is whole, else the newest
    whole one before it; None (and no lines) when `root` holds no checkpoint at all."""
    notes: list[str] = []
    marker = root / LATEST
    named = marker.read_text().strip() if marker.is_file() else ""
    steps = complete_steps(root)
    if named.startswith("iter_") and named[5:].isdigit():
        limit = int(named[5:])
    elif named:
        notes.append(f"{marker}: names {named!r}, not a checkpoint: ignored")
        limit = max(steps, default=-1)
    else:
        limit = max(steps, default=-1)
    for tmp in sorted(root.glob("iter_*.tmp")):
        notes.append(f"{tmp.name}: an interrupted save (killed while saving): skipped, never loaded")
    if named.startswith("iter_") and not (root / named).is_dir():
        notes.append(f"{named}: '{LATEST}' names it, but it does not exist")
    for step in sorted((s for s in steps if s <= limit), reverse=True):
        path = root / iter_name(step)
        why = problem(path)
        if not why:
            if not marker.is_file():
                notes.append(f"{marker} is missing: the newest whole checkpoint is {path.name}")
            return path, notes
        notes.append(f"{path.name}: corrupt or partial ({why}): skipped, never loaded")
    return None, notes


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
        if why := problem(path):
            raise ConfigError(f"--ckpt-step {ckpt_step}: {path} is corrupt or partial: {why}")
        return path
    if not root.is_dir():
        return None
    path, notes = find_resume(root)
    if path is None and notes:  # checkpoints were there, and none is whole: starting afresh would hide the loss
        raise ConfigError(f"--load {load}: no whole checkpoint there:\n  " + "\n  ".join(notes))
    return path
