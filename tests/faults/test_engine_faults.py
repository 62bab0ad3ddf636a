"""The built-in engine in its own process survives a crash (SIGKILL) and a hang (SIGSTOP): found within a second or
within the health timeout, restarted with the current weights, the request in flight sent again, and the answer
the one an engine that never failed gives (seeded sampling: no sample lost or changed). Past its restarts, the
error names the engine and its last error."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import make_tiny_hf_model
from safetensors.torch import load_file

from megarl.rollout.base import SamplingParams
from megarl.rollout.builtin import BuiltinEngine
from megarl.rollout.engine_process import EngineDeadError, EngineProcess
from megarl.rollout.weight_sync import push

pytestmark = [pytest.mark.faults, pytest.mark.distributed]
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1]]


def _tokens(completions):
    return [[c.token_ids for c in group] for group in completions]


def test_a_crashed_then_a_hung_engine_process_is_restarted_with_its_weights_and_answers_the_same(tmp_path):
    out = make_tiny_hf_model(tmp_path / "hf", "qwen2")
    config, weights = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}  # not the HF weights
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=7)
    local = BuiltinEngine(config)
    push(local, trained.items(), 4, bucket_bytes=50_000)
    expected = _tokens(local.generate(PROMPTS, params))

    remote = EngineProcess(config, threads=1, timeout_s=120, health_timeout_s=3.0, max_restarts=2)
    try:
        push(remote, trained.items(), 4, bucket_bytes=50_000)  # several buckets: each one goes to the new child
        assert _tokens(remote.generate(PROMPTS, params)) == expected

        remote.kill_for_fault(hang=False)
        t0 = time.monotonic()
        assert _tokens(remote.generate(PROMPTS, params)) == expected
        assert remote.restarts == 1 and remote.weight_version == 4
        crash_s = time.monotonic() - t0

        remote.kill_for_fault(hang=True)
        t0 = time.monotonic()
        assert _tokens(remote.generate(PROMPTS, params)) == expected
        hang_s = time.monotonic() - t0
        assert remote.restarts == 2 and 3.0 <= hang_s < 60, hang_s
        print(f"engine crash: recovered in {crash_s:.1f} s; engine hang (health timeout 3 s): {hang_s:.1f} s; "
              f"{remote.seconds_lost:.1f} s lost in all")

        remote.kill_for_fault(hang=False)
        with pytest.raises(EngineDeadError, match=r"built-in rollout engine process stopped the run after 2 "
                                                   r"restart\(s\) \(--engine-max-restarts 2\); its last error: .*"
                                                   r"exit code -9"):
            remote.generate(PROMPTS, params)
    finally:
        remote.shutdown()
