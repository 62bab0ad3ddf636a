"""Context parallelism on CPU processes over gloo (tests/distributed/cp_worker.py). The attention itself cannot
run with CP on CPU (it needs Transformer Engine): what runs here is everything around it."""

from __future__ import annotations

import json

import pytest
from helpers import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_cp2_dp2_groups_gather_and_broadcast(tmp_path):
    torchrun(4, "tests/distributed/cp_worker.py", "--out", tmp_path, "--cp", 2, timeout=240)
    ranks = [json.loads((tmp_path / f"cp-rank{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        # Megatron's rank order is tp-cp-dp-pp: CP partners are neighbours, DP ranks stride by CP.
        assert (r["cp_rank"], r["dp_rank"]) == (r["rank"] % 2, r["rank"] // 2)
        assert (r["cp_size"], r["dp_size"], r["replica_size"]) == (2, 2, 2)
        assert r["replica_ranks"] == r["cp_ranks"] == [2 * r["dp_rank"], 2 * r["dp_rank"] + 1]
        assert r["is_mp_leader"] == (r["cp_rank"] == 0)
        assert r["gather_exact"] and r["grad_exact"]
        assert r["broadcast"] == {"from": 2 * r["dp_rank"]}
        assert "--context-parallel-size 2 needs the Transformer Engine layer spec" in r["policy_error"]
