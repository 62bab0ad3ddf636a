"""The `gpu` extra is one tested set: exact pins, the table of docs/gpu-stack.md, megatron-core pinned where the
code targets it, and Transformer Engine inside the range megatron-core itself tests.

Offline and cheap: setup.py is run with `setuptools.setup` stood in for, the references are the doc's table and the
installed megatron-core's own metadata. SGLang's pins (torch, transformers) are checked against its wheel in
tests/contracts/test_gpu_stack_contract.py.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import re
import runpy
from pathlib import Path
from unittest import mock

import setuptools
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=1)
def setup_kwargs() -> dict:
    with mock.patch.object(setuptools, "setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    return setup.call_args.kwargs


def key(req: Requirement) -> str:
    return req.name.lower() + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")


def exact_pins(requirements: list[str]) -> dict[str, str]:
    """name[extras] -> version, refusing anything but one `==` per requirement."""
    pins = {}
    for text in requirements:
        req = Requirement(text)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{text!r} is not pinned to one exact version"
        pins[key(req)] = specs[0].version
    return pins


def documented_set() -> dict[str, str]:
    """The table under '## The tested set' in docs/gpu-stack.md: package -> version."""
    text = (ROOT / "docs" / "gpu-stack.md").read_text()
    section = text.split("\n## The tested set", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    assert rows[0][:2] == ["package", "version"] and set(rows[1][0]) == {"-"}, rows[:2]
    return {key(Requirement(r[0])): r[1] for r in rows[2:]}


def only(requirements: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in requirements if Requirement(r).name.lower() == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def test_gpu_extra_pins_exactly_the_documented_set():
    gpu = exact_pins(setup_kwargs()["extras_require"]["gpu"])
    assert gpu == documented_set()
    assert {"torch", "megatron-core", "sglang", "transformers"} <= gpu.keys()


def test_megatron_core_is_pinned_to_the_release_the_code_runs_against():
    """The base requirement, not just the extra: a range let Python 3.12 pick 0.19.2, which the code (cpu_compat's
    patch points, the inference engine, the TE names) was never run against."""
    kw = setup_kwargs()
    base = exact_pins([str(only(kw["install_requires"], "megatron-core"))])["megatron-core"]
    assert exact_pins([str(only(kw["extras_require"]["gpu"], "megatron-core"))])["megatron-core"] == base
    assert md.version("megatron-core") == base  # the release every test of this suite runs against


def test_transformer_engine_is_in_megatron_core_tested_range():
    """megatron-core's own `dev` extra names the Transformer Engine versions (and CUDA core) it is tested with."""
    te = only(setup_kwargs()["extras_require"]["gpu"], "transformer-engine")
    tested = [Requirement(r) for r in md.requires("megatron-core") or []
              if Requirement(r).name == "transformer-engine" and 'extra == "dev"' in r]
    assert len(tested) == 1, md.requires("megatron-core")
    (version,) = exact_pins([str(te)]).values()
    assert tested[0].specifier.contains(version, prereleases=True), (version, str(tested[0].specifier))
    assert te.extras == tested[0].extras, (te.extras, tested[0].extras)


def test_the_sglang_extra_keeps_its_meaning_and_the_gpu_set_version():
    extras = setup_kwargs()["extras_require"]
    assert extras["sglang"] == [f"sglang=={exact_pins(extras['gpu'])['sglang']}"]
    assert re.fullmatch(r"transformer-engine\[pytorch\]", " ".join(extras["transformer-engine"]))
