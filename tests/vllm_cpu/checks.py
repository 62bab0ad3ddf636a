"""The checks of megarl's vLLM adapter against vLLM itself, run in the vLLM environment (`make vllm-env`) by
tests/vllm_cpu/test_vllm_engine.py: one engine for all of them (its start-up is most of the time), each check's result
or error written as one JSON object, which the tests read check by check.

    python checks.py MODEL_DIR OUT_JSON
"""

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megarl.rollout.base import SamplingParams
from megarl.rollout.engine_process import EngineDeadError
from megarl.rollout.vllm_engine import VLLMEngine
from megarl.rollout.weight_sync import pack_buckets

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """transformers' own log_softmax(logits / T) (raw for T = 0) at each generated token."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def max_diff(engine_groups, model, temperature: float) -> float:
    worst = 0.0
    for prompt, group in zip(PROMPTS, engine_groups):
        for c in group:
            ref = hf_logprobs(model, prompt, c.token_ids, temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref)))
    return worst


def state(engine, params):
    return [[(c.token_ids, c.logprobs) for c in g] for g in engine.generate(PROMPTS, params)]


def run(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    results, t0 = {}, time.time()
    engine = VLLMEngine.launch(str(model_dir), dtype="float32", seed=0, max_model_len=64, tokenizer=True)
    results["startup_s"] = round(time.time() - t0, 1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    sampled = SamplingParams(n=3, temperature=0.8, max_new_tokens=12, seed=7)

    def check(name, fn):
        try:
            results[name] = {"ok": True, "value": fn()}
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"ok": False, "error": traceback.format_exc()}

    def generate_greedy():
        t = time.time()
        groups = engine.generate(PROMPTS, greedy)
        hf_tokens = []
        for prompt in PROMPTS:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
            hf_tokens.append(out[0, len(prompt):].tolist())
        return {"max_logprob_diff": max_diff(groups, hf, 0.0), "tokens": [g[0].token_ids for g in groups],
                "hf_tokens": hf_tokens, "finish": [g[0].finish_reason for g in groups], "s": round(time.time() - t, 2)}

    def generate_sampled():
        groups = engine.generate(PROMPTS, sampled)
        again = engine.generate(PROMPTS, sampled)
        return {"max_logprob_diff": max_diff(groups, hf, sampled.temperature),
                "sizes": [len(g) for g in groups], "lengths": [[len(c.token_ids) for c in g] for g in groups],
                "seeded_same": [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in again]}

    def stop_token():
        first = engine.generate(PROMPTS[:1], greedy)[0][0].token_ids
        stop = first[3]
        got = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                          stop_token_ids=(stop,)))[0][0]
        return {"tokens": got.token_ids, "expected": first[: first.index(stop) + 1], "finish": got.finish_reason}

    def score():
        seqs = [p + g[0].token_ids for p, g in zip(PROMPTS, engine.generate(PROMPTS, greedy))]
        got = engine.score(seqs, [len(p) for p in PROMPTS])
        ref = [hf_logprobs(hf, s[:len(p)], s[len(p):], 1.0) for s, p in zip(seqs, PROMPTS)]
        ids, logp = engine.score_topk(seqs[:1], [len(PROMPTS[0])], 3)[0]
        with torch.no_grad():
            full = hf(torch.tensor([seqs[0]])).logits[0, len(PROMPTS[0]) - 1 : -1].double().log_softmax(-1)
        top = full.topk(3, -1)
        return {"max_logprob_diff": max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g, r)),
                "lengths_ok": [len(g) for g in got] == [len(r) for r in ref],
                "topk_ids_same": bool((ids == top.indices).all()),
                "topk_max_diff": float((logp - top.values).abs().max())}

    def weight_round_trip():
        original = {k: v.clone() for k, v in hf.state_dict().items()}
        before = state(engine, greedy)
        torch.manual_seed(1)
        noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
        t = time.time()
        engine.load_weight_buckets(pack_buckets(noisy.items(), bucket_bytes=64 << 10), version=1)
        sync_s = time.time() - t
        changed = state(engine, greedy)
        hf.load_state_dict(noisy)
        diff_new = max_diff(engine.generate(PROMPTS, greedy), hf, 0.0)
        n_buckets = len(list(pack_buckets(original.items(), bucket_bytes=64 << 10)))
        engine.update_weights(original.items(), version=2)
        hf.load_state_dict(original)
        restored = state(engine, greedy)
        stamps = {c.weight_version for g in engine.generate(PROMPTS, greedy) for c in g}
        return {"changed": changed != before, "restored_exact": restored == before, "diff_vs_hf_new": diff_new,
                "buckets": n_buckets, "sync_s": round(sync_s, 3), "versions": sorted(stamps)}

    def sleep_wake():
        before = state(engine, greedy)
        engine.llm.sleep(level=1)
        awake = engine.llm.wake_up()
        engine.release_memory()
        engine.resume_memory()
        return {"wake_up_returned": awake, "same_after": state(engine, greedy) == before,
                "colocated": engine.colocated}

    def truncation_refused():
        try:
            engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, top_k=5))
        except ValueError as e:
            return str(e)
        raise AssertionError("top_k with temperature 1 was not refused")

    def head_size_refused():
        with tempfile.TemporaryDirectory() as d:
            config = json.loads((model_dir / "config.json").read_text())
            (Path(d) / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4}))  # head_dim 16
            try:
                VLLMEngine.launch(d)
            except ValueError as e:
                return str(e)
        raise AssertionError("a head size vLLM's CPU attention does not take was not refused at launch")

    def restart():
        """A second engine, watched (health timeout 3 s, one restart): synced to other weights, its processes
        SIGKILLed, then the same greedy requests; then SIGSTOPped with no restart left."""
        watched = VLLMEngine.launch(str(model_dir), dtype="float32", seed=0, max_model_len=64, health_timeout_s=3.0,
                                    max_restarts=1, timeout_s=600)
        try:
            torch.manual_seed(2)
            noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.state_dict().items()}
            watched.load_weight_buckets(pack_buckets(noisy.items(), bucket_bytes=64 << 10), version=1)
            expected, pids = state(watched, greedy), list(watched.watch.pids)
            watched.kill_for_fault(hang=False)
            t = time.time()
            after = state(watched, greedy)
            crash_s, restarts, new_pids = time.time() - t, watched.restarts, list(watched.watch.pids)
            watched.kill_for_fault(hang=True)
            t = time.time()
            try:
                watched.generate(PROMPTS, greedy)
                stopped = None
            except EngineDeadError as e:
                stopped = str(e)
            return {"tokens_same": [[c[0] for c in g] for g in after] == [[c[0] for c in g] for g in expected],
                    "logprob_diff": max(abs(a - b) for ga, gb in zip(after, expected)
                                        for (_, la), (_, lb) in zip(ga, gb) for a, b in zip(la, lb)),
                    "weights_matter": expected != state(engine, greedy), "restarts": restarts,
                    "version": watched.weight_version, "new_pids": not set(new_pids) & set(pids),
                    "crash_s": round(crash_s, 1), "stopped": stopped, "stop_s": round(time.time() - t, 1),
                    "seconds_lost": round(watched.seconds_lost, 1)}
        finally:
            watched.watch.kill(watched.llm)

    for name, fn in [("head_size_refused", head_size_refused),
                     ("generate_greedy", generate_greedy), ("generate_sampled", generate_sampled),
                     ("stop_token", stop_token), ("score", score), ("weight_round_trip", weight_round_trip),
                     ("sleep_wake", sleep_wake), ("truncation_refused", truncation_refused), ("restart", restart)]:
        check(name, fn)
    t = time.time()
    engine.shutdown()
    results["shutdown_s"] = round(time.time() - t, 2)
    return results


if __name__ == "__main__":
    out = Path(sys.argv[2])
    out.write_text(json.dumps(run(Path(sys.argv[1]))))
