"""`make gpu-check`'s pieces that run without a GPU: the plan and the skips on a CPU machine, the dry run's size
check (tools/gpu_carry.py), the wheel closure check, and how parts (b) and (c) judge a run's metrics."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from helpers import REPO, env


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


carry = _tool("gpu_carry")
train_check = _tool("gpu_check_train")
MIB = 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine make gpu-check runs the parts")
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_on_cpu_prints_the_plan_and_skips_every_part(tmp_path):
    proc = subprocess.run(["make", "-s", "gpu-check"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**env(), "PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("== gpu-check plan")
    for part in ("setup", "d", "a", "starter", "b", "c"):
        assert any(line.split()[:1] == [part] for line in lines[1:8]), f"the plan names no part {part}"
        assert f"SKIP {part} (0s): no CUDA GPU" in proc.stdout
    assert "torch" in proc.stdout and "sees no CUDA GPU" in proc.stdout  # the reason, with the interpreter's torch
    summary = lines[-1]
    assert summary.startswith("gpu-check: setup SKIP 0s (no CUDA GPU)")
    for part in ("a", "b", "c", "d"):
        assert f" {part} SKIP 0s (no CUDA GPU)" in summary


def test_gpu_check_refuses_an_unknown_part():
    proc = subprocess.run(["bash", str(REPO / "tools/gpu_check.sh"), "--parts", "a,e"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown part e (allowed: a, b, c, d)" in proc.stderr


def test_carry_report_fits_and_names_the_largest_files():
    tree = [("megarl/train.py", 10_000), ("docs/guide.md", 3 * MIB)]
    lines, ok = carry.carry_report(tree, {".cache/gpu-wheels": [("a.whl", 50 * MIB)]}, limit_mib=64)
    assert ok
    assert "docs/guide.md" in lines[1]  # the largest first
    assert lines[-1].split()[1:5] == ["53.01", "MiB", "of", "64"] and lines[-1].endswith("fits")


def test_carry_report_fails_over_the_limit_by_the_tree_and_folders_together():
    tree = [("big.bin", 20 * MIB)]
    lines, ok = carry.carry_report(tree, {".cache/gpu-wheels": [("x.whl", 45 * MIB)]}, limit_mib=64)
    assert not ok and lines[-1].endswith("over by 1.00 MiB")
    # each alone fits: only the sum is over
    assert carry.carry_report(tree, {}, limit_mib=64)[1]
    assert carry.carry_report([], {".cache/gpu-wheels": [("x.whl", 45 * MIB)]}, limit_mib=64)[1]


def test_carry_report_fails_when_a_carried_folder_is_missing_unless_it_is_optional():
    lines, ok = carry.carry_report([("a.py", 10)], {".cache/gpu-wheels": None})
    assert not ok and any("missing (`make gpu-wheels` fetches it)" in line for line in lines)
    folders = {".cache/gpu-wheels": [("w.whl", MIB)], ".cache/starter": None}
    lines, ok = carry.carry_report([("a.py", 10)], folders, optional=(".cache/starter",))
    assert ok and any(".cache/starter" in line and "absent (optional" in line for line in lines)


def test_dry_run_counts_the_working_tree_as_carried_and_not_what_git_ignores(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, timeout=60)
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/.cache/\n/runs/\n")
    (tmp_path / "tracked.py").write_bytes(b"x" * 1000)
    git("add", ".")
    (tmp_path / "untracked.txt").write_bytes(b"y" * 500)  # untracked, not ignored: carried
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "big.bin").write_bytes(b"z" * (3 * MIB))  # ignored and not in the carry list
    (tmp_path / ".cache" / "gpu-wheels").mkdir(parents=True)
    (tmp_path / ".cache" / "gpu-wheels" / "w.whl").write_bytes(b"w" * (2 * MIB))
    (tmp_path / ".cache" / "starter").mkdir()  # named optional below, and present: counted
    (tmp_path / ".cache" / "starter" / "model.safetensors").write_bytes(b"s" * (MIB // 4))
    assert sorted(carry.tree_files(tmp_path)) == [(".gitignore", 16), ("tracked.py", 1000), ("untracked.txt", 500)]
    run = lambda limit: subprocess.run([sys.executable, str(REPO / "tools/gpu_carry.py"), "size", "--root",
                                        str(tmp_path), "--limit-mib", str(limit), "--optional", ".cache/starter"],
                                       capture_output=True, text=True, timeout=60)
    fits, over = run(64), run(1.75)
    assert fits.returncode == 0 and ".cache/gpu-wheels" in fits.stdout and "big.bin" not in fits.stdout
    assert over.returncode == 1 and "over by 0.50 MiB" in over.stdout


def _wheel(directory, name: str, version: str, requires: list[str]):
    path = directory / f"{name}-{version}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires), "\nA description: with colons\n"])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_closure_names_each_dependency_no_wheel_meets(tmp_path):
    wheels = [_wheel(tmp_path, "app", "1.0", ["lib>=2", "torch>=2.4", "gone", 'tomli; python_version < "3.11"',
                                              "extra-only; extra == 'dev'", "Typing_Extensions>=4"]),
              _wheel(tmp_path, "lib", "1.5", [])]
    unmet = carry.unmet_requirements(wheels, "3.12")
    assert unmet == ["app-1.0-py3-none-any.whl: lib>=2 (the wheel is 1.5)",
                     "app-1.0-py3-none-any.whl: gone (no wheel)"]
    _wheel(tmp_path, "gone", "0.1", [])
    (tmp_path / "lib-1.5-py3-none-any.whl").unlink()
    _wheel(tmp_path, "lib", "2.0", [])
    ok = subprocess.run([sys.executable, str(REPO / "tools/gpu_carry.py"), "closure", str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "every dependency met" in ok.stdout


def test_gpu_wheels_list_is_pinned_and_has_megatron_core():
    reqs = [line.split("#")[0].strip() for line in (REPO / "tools/gpu_wheels.txt").read_text().splitlines()]
    reqs = [r for r in reqs if r]
    assert all(r.count("==") == 1 for r in reqs), [r for r in reqs if "==" not in r]
    assert "megatron-core==0.16.1" in reqs and not any(r.startswith(("torch==", "matplotlib")) for r in reqs)


def test_sync_judgement_needs_a_verified_sync_after_an_update_on_the_gpu():
    rows = [{"step": 1, "sync_probe_version": 0, "sync_probe_absdiff_mean": 1e-7, "sync_peak_gpu_mib": 12.0},
            {"step": 2, "sync_probe_version": 1, "sync_probe_absdiff_mean": 2e-7, "sync_peak_gpu_mib": 12.0}]
    ok, why = train_check.judge_sync(rows, "cuda")
    assert ok and "versions [1]" in why
    assert not train_check.judge_sync(rows[:1], "cuda")[0]  # only the initial sync was checked
    on_cpu = [dict(r, sync_peak_gpu_mib=0.0) for r in rows]
    assert train_check.judge_sync(on_cpu, "cpu")[0]
    ok, why = train_check.judge_sync(on_cpu, "cuda")
    assert not ok and "did not run on the GPU" in why


def test_learning_judgement_compares_the_first_and_last_five_steps():
    rising = [{"reward_mean": 0.2 + 0.01 * i} for i in range(30)]
    ok, why = train_check.judge_learning(rising, 30)
    assert ok and why.startswith("reward first 0.200 -> last 0.490")
    flat = [{"reward_mean": 0.3} for _ in range(30)]
    ok, why = train_check.judge_learning(flat, 30)
    assert not ok and why.endswith("the reward did not rise")
    assert not train_check.judge_learning(rising[:20], 30)[0]  # a run that stopped early


@pytest.mark.slow
def test_actor_part_passes_on_cpu():
    """Part (a)'s script itself, on CPU over gloo: the dense model against transformers, before and after an
    update (on a GPU the same code runs on CUDA)."""
    proc = subprocess.run([sys.executable, str(REPO / "tools/gpu_check_actor.py"), "--device", "cpu", "--families",
                           "qwen2"], cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("PASS: bf16 log-probs within the bound")


def test_learning_pool_is_evenly_spaced_rows_of_the_training_set(tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(f'{{"prompt": "{i}+0=", "answer": "{i}"}}\n' for i in range(100)))
    pool = train_check.write_pool(source, tmp_path / "out" / "pool.jsonl", 4)
    assert [line.split('"')[3] for line in pool.read_text().splitlines()] == ["0+0=", "25+0=", "50+0=", "75+0="]
    with pytest.raises(SystemExit, match="--pool 101: .* has 100 problems"):
        train_check.write_pool(source, tmp_path / "pool.jsonl", 101)
