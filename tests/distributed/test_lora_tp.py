"""LoRA at TP 2, PP 2 and EP 2 against `peft` (tests/lora_checks.py holds the checks; tests/unit/test_lora.py runs
them at TP 1): column-parallel layers with A replicated and B split by output rows, row-parallel ones with A split by
input columns and B replicated, with and without sequence parallelism; at PP 2 each stage's adapters on its own
layers, the merged export and the gradients gathered over stages; at EP 2 (Qwen3-MoE) each rank's experts' adapters,
gathered over EP into PEFT's fused expert tensors. On four processes, TP 2 x PP 2 (Qwen2; Qwen3-MoE with EP 2 and
expert-TP 1, sequence parallel as Megatron's MoE layer requires at TP 2): both at once, each stage's shards. One
torchrun over gloo per process count."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import REPO, make_tiny_hf_model, torchrun
from lora_checks import ALL, MOE, check_against_peft, peft_side

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("peft", reason="peft (the dev extra) is the independent reference for LoRA")
# model:tp,pp,ep,sequence_parallel, by the number of processes
LAYOUTS = {2: {"qwen2:2,1,1,0": "TP 2", "qwen2:2,1,1,1": "TP 2, sequence parallel", "qwen2:1,2,1,0": "PP 2",
               "moe:1,1,2,0": "Qwen3-MoE, EP 2"},
           4: {"qwen2:2,2,1,0": "TP 2 x PP 2", "moe:2,2,2,1": "Qwen3-MoE, TP 2 x PP 2 x EP 2, sequence parallel"}}


@pytest.mark.parametrize("nproc", sorted(LAYOUTS), ids=lambda n: f"{n}ranks")
def test_megatron_lora_matches_peft_at_tp2_pp2_and_ep2(tiny_qwen2, tmp_path, nproc):
    moe = make_tiny_hf_model(tmp_path / "qwen3_moe", "qwen3_moe", layers=2, mlp_only_layers=[1])
    out = tmp_path / "lora_tp2.pt"
    tests = os.pathsep.join([str(REPO / "tests"), str(REPO)])  # tests/lora_checks.py, megarl
    layouts = LAYOUTS[nproc]
    torchrun(nproc, "tests/distributed/lora_worker.py", "--hf", f"qwen2={tiny_qwen2},moe={moe}", "--out", out,
             "--layouts", ";".join(layouts), timeout=400, extra_env={"PYTHONPATH": tests})
    results = torch.load(out, weights_only=False)
    assert set(results) == set(layouts)
    for layout, meg in results.items():
        hf, targets = (moe, MOE) if layout.startswith("moe:") else (tiny_qwen2, ALL)
        try:
            check_against_peft(meg, peft_side(hf, meg["values"], targets, meg["adapters_after"]))
        except AssertionError as e:
            raise AssertionError(f"{layouts[layout]}: {e}") from e
