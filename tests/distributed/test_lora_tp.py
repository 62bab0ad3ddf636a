"""LoRA at TP 2 against `peft` (tests/lora_checks.py holds the checks; tests/unit/test_lora.py runs them at TP 1):
column-parallel layers with A replicated and B split by output rows, row-parallel ones with A split by input
columns and B replicated, with and without sequence parallelism, in one torchrun of two CPU processes over gloo."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, torchrun
from lora_checks import ALL, check_against_peft, peft_side

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("peft", reason="peft (the dev extra) is the independent reference for LoRA")


def test_megatron_lora_matches_peft_at_tp2_with_and_without_sequence_parallelism(tiny_qwen2, tmp_path):
    out = tmp_path / "lora_tp2.pt"
    tests = os.pathsep.join([str(REPO / "tests"), str(REPO)])  # tests/lora_checks.py, megarl
    torchrun(2, "tests/distributed/lora_worker.py", "--hf", tiny_qwen2, "--out", out, "--tp", 2, timeout=400,
             extra_env={"PYTHONPATH": tests})
    results = torch.load(out, weights_only=False)
    for sp in (False, True):
        meg = results[sp]
        check_against_peft(meg, peft_side(tiny_qwen2, meg["values"], ALL, meg["adapters_after"]))
