"""`tools/bench/tool_attacks.py` on a small batch: four tool_use trajectories (one prompt, n = 4) per attack of the
sandbox's containment suite, every one finished, nothing left on the host (the bench's own checks; 1,000
trajectories is its default)."""

from __future__ import annotations

import tool_attacks  # tools/bench/tool_attacks.py (tests/conftest.py puts tools/bench on the path)


def test_attacks_inside_tool_calls_are_contained():
    report = tool_attacks.run(trajectories=48, batch=48, timeout=2.0, workers=2, sandbox="local")
    assert report["failures"] == [] and (report["finished"], report["lost"]) == (48, 0)
    obs = report["observations"]
    assert sum(sum(c.values()) for c in obs.values()) == 48 and len(obs) == 12
    assert obs["infinite_loop"] == {"timeout": 4} and obs["harmless"] == {"ok": 4}
    assert obs["output_100mb"] == {"error": 4}
    assert sum(obs["memory_bomb"].values()) == 4 and set(obs["memory_bomb"]) <= {"error", "timeout"}  # a slow host
