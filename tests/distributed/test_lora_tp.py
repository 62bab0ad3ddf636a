"""LoRA at TP 2 and PP 2 against `peft` (tests/lora_checks.py holds the checks; tests/unit/test_lora.py runs them at
TP 1): column-parallel layers with A replicated and B split by output rows, row-parallel ones with A split by input
columns and B replicated, with and without sequence parallelism; at PP 2 each stage's adapters on its own layers, the
merged export and the gradients gathered over stages. One torchrun of two CPU processes over gloo."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, torchrun
from lora_checks import ALL, check_against_peft, peft_side

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("peft", reason="peft (the dev extra) is the independent reference for LoRA")
LAYOUTS = {"2,1,0": "TP 2", "2,1,1": "TP 2, sequence parallel", "1,2,0": "PP 2"}  # tp,pp,sequence_parallel


def test_megatron_lora_matches_peft_at_tp2_with_and_without_sequence_parallelism_and_at_pp2(tiny_qwen2, tmp_path):
    out = tmp_path / "lora_tp2.pt"
    tests = os.pathsep.join([str(REPO / "tests"), str(REPO)])  # tests/lora_checks.py, megarl
    torchrun(2, "tests/distributed/lora_worker.py", "--hf", tiny_qwen2, "--out", out, "--layouts", ";".join(LAYOUTS),
             timeout=400, extra_env={"PYTHONPATH": tests})
    results = torch.load(out, weights_only=False)
    assert set(results) == set(LAYOUTS)
    for layout, meg in results.items():
        try:
            check_against_peft(meg, peft_side(tiny_qwen2, meg["values"], ALL, meg["adapters_after"]))
        except AssertionError as e:
            raise AssertionError(f"{LAYOUTS[layout]}: {e}") from e
