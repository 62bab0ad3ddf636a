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


# The in-process SGLang engine's health (`SGLangEngine` over `megarl.rollout.sglang_health`), on a stand-in whose
# "scheduler" is a child process holding the weights (SGLang itself: tests/sglang_cpu/test_sglang_engine_faults.py).
_SCHEDULER = """
import json, sys
shift = 0
for line in sys.stdin:
    req = json.loads(line)
    if "load" in req:
        shift = req["load"]
        print(json.dumps("ok"), flush=True)
        continue
    out = []
    for ids, s in zip(req["input_ids"], req["sampling_params"]):
        toks = [(sum(ids) + shift + k) % 50 for k in range(s["max_new_tokens"])]
        out.append({"output_ids": toks, "meta_info": {"output_token_logprobs": [[-0.5, t] for t in toks],
                                                      "finish_reason": {"type": "length"}}})
    print(json.dumps(out), flush=True)
"""


class _StandInEngine:
    """`sglang.Engine`'s calls the adapter makes, answered by a child process (`_SCHEDULER`)."""

    def __init__(self):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _SCHEDULER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def generate(self, input_ids, sampling_params, return_logprob=True, **_):
        return self._ask({"input_ids": input_ids, "sampling_params": sampling_params})

    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        return self._ask({"load": named_tensors[0]})

    def flush_cache(self):
        pass

    def shutdown(self):
        self.proc.kill()
        self.proc.wait()


def test_a_watched_sglang_engine_is_restarted_with_its_weights_and_the_call_sent_again(capfd):
    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.rollout.sglang_health import EngineWatch

    engines = []  # (stand-in, its watch) of every launch, for the clean-up

    def launch():
        engines.append(EngineWatch.launched(_StandInEngine, health_timeout_s=2.0))
        return engines[-1]

    engine = SGLangEngine(*launch()[:1], colocated=False, watch=engines[0][1], relaunch=launch, max_restarts=2,
                          timeout_s=60, serialize=lambda b, tp: [int(b.flat.sum())])
    try:
        weights = {"w": torch.full((4,), 3.0)}  # the stand-in's "weights": a shift of every token
        push(engine, weights.items(), 5, bucket_bytes=1 << 20)
        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
        expected = _tokens(engine.generate(PROMPTS, params))
        assert expected != _tokens(SGLangEngine(_StandInEngine()).generate(PROMPTS, params)), "weights matter"

        engine.kill_for_fault(hang=False)
        t0 = time.monotonic()
        assert _tokens(engine.generate(PROMPTS, params)) == expected
        crash_s = time.monotonic() - t0
        assert engine.restarts == 1 and engine.weight_version == 5 and engine.watch is engines[1][1]

        engine.kill_for_fault(hang=True)
        t0 = time.monotonic()
        assert _tokens(engine.generate(PROMPTS, params)) == expected
        hang_s = time.monotonic() - t0
        assert engine.restarts == 2 and 2.0 <= hang_s < 30, hang_s
        err = capfd.readouterr().err
        assert "died during the 'generate' call: its process" in err
        assert "is hung: the 'generate' call unanswered and no CPU used by its processes for" in err

        engine.kill_for_fault(hang=False)
        with pytest.raises(EngineDeadError, match=r"the SGLang engine stopped the run after 2 restart\(s\) "
                                                   r"\(--engine-max-restarts 2\); its last error: the SGLang engine "
                                                   r"\(scheduler and detokenizer pids \d+\) died during the "
                                                   r"'generate' call"):
            engine.generate(PROMPTS, params)
        with capfd.disabled():
            print(f"watched SGLang stand-in: crash answered after {crash_s:.1f} s, hang (timeout 2 s) after "
                  f"{hang_s:.1f} s; {engine.seconds_lost:.1f} s lost in all")
    finally:
        for e, _ in engines:
            e.shutdown()


@pytest.mark.parametrize("hang", [False, True], ids=["crash", "hang"])
def test_an_sglang_engine_that_fails_during_a_weight_sync_starts_again_with_the_new_weights(capfd, hang):
    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.rollout.sglang_health import EngineWatch

    engines, loads = [], []

    def launch():
        engines.append(EngineWatch.launched(_StandInEngine, health_timeout_s=2.0))
        return engines[-1]

    def serialize(bucket, tp):  # the second sync's bucket, on its way to the first engine: the engine fails
        loads.append(len(engines))
        if len(loads) == 2:
            engine.kill_for_fault(hang=hang)
        return [int(bucket.flat.sum())]

    engine = SGLangEngine(*launch()[:1], colocated=False, watch=engines[0][1], relaunch=launch, max_restarts=1,
                          timeout_s=60, serialize=serialize)
    reference = SGLangEngine(_StandInEngine(), serialize=lambda b, tp: [int(b.flat.sum())])
    try:
        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=5)
        push(engine, {"w": torch.full((4,), 3.0)}.items(), 5, bucket_bytes=1 << 20)
        before = _tokens(engine.generate(PROMPTS, params))
        push(engine, {"w": torch.full((4,), 7.0)}.items(), 6, bucket_bytes=1 << 20)
        assert engine.restarts == 1 and engine.weight_version == 6 and engine.watch is engines[1][1]
        assert loads == [1, 1, 2]  # the new engine loaded the sync's weights as it started, and nothing twice
        push(reference, {"w": torch.full((4,), 7.0)}.items(), 6, bucket_bytes=1 << 20)
        after = _tokens(engine.generate(PROMPTS, params))
        assert after == _tokens(reference.generate(PROMPTS, params)) != before
        err = capfd.readouterr().err
        assert ("is hung: the" if hang else "died during the") + " 'weight sync to version 6' call" in err
        assert "restarting the engine (restart 1 of 1), with weights version 6" in err

        engine.kill_for_fault(hang=False)  # no restart left: the run stops naming the sync
        with pytest.raises(EngineDeadError, match=r"the SGLang engine stopped the run after 1 restart\(s\) "
                                                   r"\(--engine-max-restarts 1\); its last error: .* died during "
                                                   r"the 'weight sync to version 7' call"):
            push(engine, {"w": torch.full((4,), 9.0)}.items(), 7, bucket_bytes=1 << 20)
        assert engine.weight_version == 6
    finally:
        reference.shutdown()
        for e, _ in engines:
            e.shutdown()
