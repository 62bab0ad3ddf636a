"""tools/bench/rollout.py at its smoke size, with the two engines that need no environment of their own (the
built-in engine and `transformers`), and SGLang and vLLM pointed at environments that do not exist: the table's
shape, the skipped rows' reasons, and every row of both modes at the requested length. No timings are judged."""

import json
import subprocess
import sys

from helpers import REPO, env


def test_smoke_table_builtin_and_transformers_rows_skips_the_absent_engines(tmp_path):
    out = tmp_path / "rows.json"
    absent = {"MEGARL_SGLANG_ENV": str(tmp_path / "no-sglang"), "MEGARL_VLLM_ENV": str(tmp_path / "no-vllm")}
    proc = subprocess.run([sys.executable, "tools/bench/rollout.py", "--smoke", "--threads", "1", "--json", str(out)],
                          cwd=REPO, env={**env(), **absent}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, head, *rows = proc.stdout.strip().splitlines()
    assert summary.startswith("model: a random Qwen2 (smoke)") and "2 prompts" in summary, summary
    assert head.split() == ["engine", "start-up", "s", "tokens", "T=1", "tok/s", "vs", "builtin", "greedy", "tok/s",
                            "vs", "builtin"]
    assert [r.split()[0] for r in rows] == ["builtin", "transformers", "sglang", "vllm"]
    for row in rows[:2]:  # start-up, tokens, T=1 rate and ratio, greedy rate and ratio
        cells = row.split()
        assert len(cells) == 7 and cells[2] == "8", row
    assert rows[0].split()[4] == rows[0].split()[6] == "1.00x"
    for row, name in zip(rows[2:], ("sglang", "vllm")):
        where = absent[f"MEGARL_{name.upper()}_ENV"]
        assert row.split()[0] == name and f"skipped: no {name} environment at {where}" in row, row

    data = json.loads(out.read_text())
    assert data["requested_tokens"] == 2 * 4
    for name in ("builtin", "transformers"):
        row = data["rows"][name]
        assert row["startup_s"] >= 0
        for mode in ("sampled", "greedy"):
            assert row["modes"][mode]["tokens"] == [4, 4], (name, mode)  # 2 prompts x 1 sample, 4 tokens each
            assert row["modes"][mode]["seconds"] > 0
    assert set(data["rows"]["sglang"]) == set(data["rows"]["vllm"]) == {"skipped"}
