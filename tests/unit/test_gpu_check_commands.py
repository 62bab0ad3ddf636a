"""tools/gpu_check.sh's pieces that run on CPU: the commands `gpu_check_tp2.py` builds (against SGLang's own
argument parser when `sglang` imports), its time budget, the stages it skips and why, the refusal without a GPU,
and the verdict lines. The stages themselves need GPUs (tests/gpu/test_colocated_path.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tp2 = _tool("gpu_check_tp2")


def test_torchrun_command_starts_this_script_as_a_worker():
    cmd = tp2.torchrun_command("/py", 2, 29611, ["--worker", "colocated", "--engine", "sglang"])
    assert cmd == ["/py", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                   "--master-port", "29611", str(REPO / "tools" / "gpu_check_tp2.py"), "--worker", "colocated",
                   "--engine", "sglang"]


def test_server_command():
    cmd = tp2.server_command("/py", "/ckpt", 30001, gpu=1, mem_fraction=0.25, cuda_graph_max_bs=8)
    assert cmd == ["/py", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "127.0.0.1", "--port",
                   "30001", "--base-gpu-id", "1", "--tp-size", "1", "--mem-fraction-static", "0.25", "--dtype",
                   "bfloat16", "--skip-tokenizer-init", "--random-seed", "0", "--enable-deterministic-inference",
                   "--cuda-graph-max-bs-decode", "8", "--log-level", "error"]


def test_server_command_parses_with_sglangs_own_arguments():
    pytest.importorskip("sglang", reason="sglang is not installed: its argument parser is not here to check against")
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(tp2.server_command("/py", "/ckpt", 30001, gpu=1)[3:])
    assert (ns.model_path, ns.port, ns.base_gpu_id, ns.tp_size, ns.skip_tokenizer_init) == ("/ckpt", 30001, 1, 1, True)
    assert ns.enable_deterministic_inference and ns.cuda_graph_max_bs_decode == 16


def test_each_stage_gets_its_limit_or_what_is_left_or_nothing():
    assert tp2.stage_limit("tp2-builtin", 1000) == tp2.STAGE_LIMIT_S["tp2-builtin"] == 120
    assert tp2.stage_limit("tp2-sglang", 200) == 200  # less than its limit, more than it needs
    assert tp2.stage_limit("disaggregated", 149) is None  # a cold SGLang start would not fit


def test_stages_that_cannot_run_say_why():
    one_gpu = tp2.why_not("tp2-builtin", gpus=1, sglang_ok=True, sglang_why="", cpu_smoke=False)
    assert "needs 2 CUDA GPUs and this machine has 1" in one_gpu and "Duplicate GPU" in one_gpu
    why = "sglang is not importable (ModuleNotFoundError: No module named 'sglang')"
    assert tp2.why_not("tp2-sglang", gpus=2, sglang_ok=False, sglang_why=why, cpu_smoke=False) == why
    assert tp2.why_not("disaggregated", gpus=2, sglang_ok=False, sglang_why=why, cpu_smoke=False) == why
    assert tp2.why_not("tp2-builtin", gpus=2, sglang_ok=False, sglang_why=why, cpu_smoke=False) is None
    assert tp2.why_not("tp2-builtin", gpus=0, sglang_ok=False, sglang_why=why, cpu_smoke=True) is None
    assert "tp2-builtin only" in tp2.why_not("tp2-sglang", gpus=0, sglang_ok=True, sglang_why="", cpu_smoke=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_both_scripts_refuse_with_the_way_to_check_them_on_cpu(capsys):
    assert tp2.main(["--stages", "tp2-builtin"]) == 2
    assert "torch sees no CUDA GPU; use --cpu-smoke" in capsys.readouterr().out
    gpu_check = _tool("gpu_check")
    assert gpu_check.main(["--parts", "tiny"]) == 2
    assert "torch sees no CUDA GPU; use --cpu-smoke" in capsys.readouterr().out


def test_unknown_stage_is_refused_with_the_choices():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check_tp2.py"), "--stages", "tp3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown ['tp3']; choose from tp2-builtin, tp2-sglang, disaggregated" in proc.stderr


def test_verdict_lines(capsys):
    gpu_check = _tool("gpu_check")
    ran = {"status": "ran", "seconds": 12.3, "sync_bytes_equal_parameter_bytes": True, "parameter_bytes": 8,
           "steps": [{"sync_probe_absdiff_max": 1e-6}, {"sync_probe_absdiff_max": 3e-6}], "peak_gpu_mib": 512.0}
    assert gpu_check.part_verdict("tiny", ran) == ("ran", "12 s, 2 verified syncs, probe |dlogp| max 3.00e-06, "
                                                           "peak GPU 512 MiB")
    wrong = dict(ran, sync_bytes_equal_parameter_bytes=False)
    assert gpu_check.part_verdict("tiny", wrong) == ("failed", "a sync moved other than the 8 parameter bytes")
    gpu_check.verdict("tiny", *gpu_check.part_verdict("tiny", wrong))
    tp2.verdict("tp2-sglang", "SKIP", "sglang is not\nimportable")
    assert capsys.readouterr().out.splitlines() == ["FAIL stage tiny: a sync moved other than the 8 parameter bytes",
                                                    "SKIP stage tp2-sglang: sglang is not importable"]


def test_gpu_check_sh_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "tools" / "gpu_check.sh")]).returncode == 0
