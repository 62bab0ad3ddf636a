"""The in-process adapter (`SGLangEngine`) against SGLang 0.5.23's own engine on CPU. Run by worker.py in the
SGLang environment; one engine for the whole module (test_engine.py runs the checks in order and says what each
proves). The reference for log-probs is the same checkpoint run by transformers in float32."""

import contextlib
import io
import threading
import time
from pathlib import Path
from unittest import mock

import torch

from megarl.rollout import mismatch, weight_sync
from megarl.rollout.base import SamplingParams
from megarl.rollout import sglang_engine
from megarl.rollout.sglang_engine import SGLangEngine, sampling_dict

STATE: dict = {}


def _reference(model_dir: str):
    if "reference" not in STATE:
        from transformers import AutoModelForCausalLM

        STATE["reference"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return STATE["reference"]


@torch.no_grad()
def _ref_logp(tokens: list[int]) -> torch.Tensor:
    """transformers' log-probs [len - 1, V] of each next token of `tokens`, with the current weights."""
    logits = _reference(STATE["model_dir"])(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def _prompts() -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(STATE["model_dir"]) / "tokenizer.json"))
    return [tok.encode(p).ids for p in ("12+7=", "30-4=", "5+5=")]


def check_colocated_refused(model_dir: str) -> str:
    """colocated=True on CPU fails at once, before SGLang starts, and says why."""
    try:
        SGLangEngine.launch(model_dir, colocated=True, device="cpu")
    except ValueError as e:
        return str(e)
    raise AssertionError("SGLangEngine.launch(colocated=True) on CPU did not refuse")


def check_launch(model_dir: str) -> dict:
    STATE["model_dir"] = model_dir
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(log):
        engine = SGLangEngine.launch(model_dir, device="cpu", dtype="float32", seed=1234, mem_fraction=0.05,
                                     max_running_requests=16, tokenizer=True)  # stop strings: multi-turn
    STATE["engine"] = engine
    return {"log": log.getvalue(), "colocated": engine.colocated, "seconds": time.perf_counter() - start}


def check_generate_logprobs() -> dict:
    """Sampled completions: log-probs one per token, equal to transformers' log softmax of the same tokens."""
    engine = STATE["engine"]
    prompts = _prompts()
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    assert len(groups) == len(prompts) and all(len(g) == 2 for g in groups), [len(g) for g in groups]
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) > 0, c
            assert c.finish_reason in ("stop", "length"), c.finish_reason
            assert c.weight_version == engine.weight_version
            ref = _ref_logp(prompt + c.token_ids)[len(prompt) - 1:]
            ref = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(c.logprobs)).abs().max()))
    assert worst < 1e-3, f"SGLang's log-probs differ from transformers' by up to {worst:.3g}"
    return {"max_abs_diff": worst}


def check_greedy_and_seed() -> dict:
    """Greedy decoding repeats; seeded sampling is not promised on CPU (the adapter says so at launch)."""
    engine = STATE["engine"]
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    a = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    b = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    assert a == b, (a, b)
    seeded = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=7)
    s1 = [[c.token_ids for c in g] for g in engine.generate(prompts, seeded)]
    s2 = [[c.token_ids for c in g] for g in engine.generate(prompts, seeded)]
    return {"seeded_repeats": s1 == s2}


def check_score() -> dict:
    """`score` (the --verify-weight-sync probe's engine side) against transformers, and T != 1 refused."""
    engine = STATE["engine"]
    probe = weight_sync.probe_sequence(80, length=32, seed=3)
    engine_logp = torch.tensor(engine.score([probe], [1], temperature=1.0)[0])
    ref = _ref_logp(probe).gather(1, torch.tensor(probe[1:])[:, None])[:, 0]
    metrics = weight_sync.check_probe(ref, engine_logp, tolerance=1e-3)
    try:
        engine.score([probe], [1], temperature=0.7)
        raise AssertionError("score at temperature 0.7 was not refused")
    except ValueError:
        pass
    return metrics


def _perturbed(scale: float) -> list[tuple[str, torch.Tensor]]:
    """The reference's weights, every floating tensor times `scale` except the norms (HF names)."""
    model = _reference(STATE["model_dir"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return [(n, p.detach().clone()) for n, p in model.state_dict().items()]


def check_weight_sync(rounds: int = 2, bucket_bytes: int = 256 << 10) -> dict:
    """Bucketed pushes (`weight_sync.push`, small buckets: several per sync) of changed weights, each followed by
    the --verify-weight-sync probe against transformers holding the same weights; the new weight version is on
    every completion generated after it."""
    engine = STATE["engine"]
    out = []
    for r in range(rounds):
        named = _perturbed(1.05 if r % 2 == 0 else 1 / 1.05)
        version = engine.weight_version + 1
        stats = weight_sync.push(engine, iter(named), version, bucket_bytes)
        engine.resume_memory()  # the adapter's post-push step: flush the prefix cache
        probe = weight_sync.probe_sequence(80, length=32, seed=version)
        engine_logp = torch.tensor(engine.score([probe], [1], temperature=1.0)[0])
        ref = _ref_logp(probe).gather(1, torch.tensor(probe[1:])[:, None])[:, 0]
        check = weight_sync.check_probe(ref, engine_logp, tolerance=1e-3)
        completions = engine.generate(_prompts()[:1], SamplingParams(max_new_tokens=4))
        assert engine.weight_version == version and completions[0][0].weight_version == version
        out.append({"version": version, "buckets": stats.buckets,
                    **stats.metrics(), **check})
    return {"rounds": out}


def check_wrong_weights_caught() -> dict:
    """The probe check fails when the engine holds other weights than the reference (a broken sync is seen)."""
    engine = STATE["engine"]
    probe = weight_sync.probe_sequence(80, length=32, seed=11)
    ref = _ref_logp(probe).gather(1, torch.tensor(probe[1:])[:, None])[:, 0]
    named = [(n, t * 1.3 if "norm" not in n else t) for n, t in _reference(STATE["model_dir"]).state_dict().items()]
    engine.update_weights(iter(named))
    engine.resume_memory()
    engine_logp = torch.tensor(engine.score([probe], [1], temperature=1.0)[0])
    try:
        weight_sync.check_probe(ref, engine_logp, tolerance=1e-3)
    except weight_sync.WeightSyncError as e:
        caught = str(e)
    else:
        raise AssertionError("the probe check passed with weights that differ from the reference")
    # back to the reference's weights
    engine.update_weights(iter(_reference(STATE["model_dir"]).state_dict().items()))
    engine.resume_memory()
    return {"caught": caught}


def check_mismatch_topk(k: int = 5) -> dict:
    """--mismatch-check-interval's engine side (`score_topk`, then `mismatch.topk_mismatch`) against transformers
    with the same weights: bounds near zero, top-1 agreeing; and a real gap when the weights differ."""
    engine = STATE["engine"]
    seqs = [p + [5, 6, 7] for p in _prompts()]
    lens = [len(p) for p in _prompts()]
    answers = engine.score_topk(seqs, lens, k)
    ids = torch.cat([a[0] for a in answers])
    logp = torch.cat([a[1] for a in answers])
    actor = torch.cat([_ref_logp(s)[n - 1:] for s, n in zip(seqs, lens)])
    assert ids.shape == logp.shape == (actor.shape[0], k), (ids.shape, actor.shape)
    same = mismatch.topk_mismatch(ids, logp, actor)
    assert same["mismatch_top1"] == 1.0 and same["mismatch_kl_fwd"] < 1e-5 and same["mismatch_tv"] < 1e-3, same
    other = mismatch.topk_mismatch(ids, logp, torch.log_softmax(actor * 0.5, -1))
    assert other["mismatch_kl_fwd"] > 10 * max(same["mismatch_kl_fwd"], 1e-6), other
    return {"same": same, "other_kl_fwd": other["mismatch_kl_fwd"]}


def check_flush() -> dict:
    """flush_cache through the adapter (`resume_memory` of a non-colocated engine) with a warm prefix cache; the
    answers after it equal the answers before (greedy)."""
    engine = STATE["engine"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = [g[0].token_ids for g in engine.generate(_prompts(), greedy)]
    engine.resume_memory()
    after = [g[0].token_ids for g in engine.generate(_prompts(), greedy)]
    assert before == after, (before, after)
    return {"ok": True}


def check_abort() -> dict:
    """Requests SGLang aborts mid-generation (`abort_request(abort_all=True)` while they run) come back as finish
    reason "abort", token and log-prob counts equal, counted in `aborted`; the engine generates normally after."""
    engine = STATE["engine"]
    long = SamplingParams(n=4, temperature=1.0, max_new_tokens=48)
    result: dict = {}

    def run():  # ignore_eos: the starter answers in a few tokens, before any abort could reach it
        with mock.patch.object(sglang_engine, "sampling_dict", lambda *a: {**sampling_dict(*a), "ignore_eos": True}):
            result["groups"] = engine.generate(_prompts(), long)

    thread = threading.Thread(target=run)
    before = engine.aborted
    thread.start()
    sgl = engine.engine  # SGLang's own Engine: abort on its event loop, as its HTTP server's /abort_request does
    deadline = time.monotonic() + 60
    while not sgl.tokenizer_manager.rid_to_state and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.02)  # abort at once: on quiet cores the 48 tokens were done within a 0.3 s wait
    sgl.loop.call_soon_threadsafe(sgl.tokenizer_manager.abort_request, "", True)
    thread.join(timeout=120)
    assert not thread.is_alive(), "generate did not return after abort_request(abort_all=True)"
    flat = [c for g in result["groups"] for c in g]
    reasons = [c.finish_reason for c in flat]
    for c in flat:
        assert len(c.token_ids) == len(c.logprobs), c
    after = engine.generate(_prompts()[:1], SamplingParams(max_new_tokens=4))
    assert after[0][0].finish_reason in ("stop", "length")
    return {"reasons": reasons, "aborted": engine.aborted - before}


def check_stop_strings() -> dict:
    """`SamplingParams.stop` (what multi-turn rollouts end a turn at, a tool call's closing tag), matched by SGLang
    on text: the completion ends with the token that completed the string, finish reason "stop", one log-prob per
    token; then a second turn from the prompt, that turn and some appended tokens (a tool's output) generates."""
    from tokenizers import Tokenizer

    engine = STATE["engine"]
    tok = Tokenizer.from_file(str(Path(STATE["model_dir"]) / "tokenizer.json"))
    prompt = _prompts()[0]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))[0][0]
    text = tok.decode(free.token_ids)
    assert text, "the starter answered nothing to stop at"
    stop = text[0]
    cut = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, stop=(stop,)))[0][0]
    assert cut.finish_reason == "stop" and stop in tok.decode(cut.token_ids), (cut, stop)
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.logprobs) == len(cut.token_ids)
    second = prompt + cut.token_ids + tok.encode("\n").ids
    more = engine.generate([second], SamplingParams(temperature=0.0, max_new_tokens=4))[0][0]
    assert len(more.token_ids) == len(more.logprobs) > 0
    return {"stop": stop, "first_turn": cut.token_ids, "second_turn": more.token_ids}


def close() -> None:
    engine = STATE.pop("engine", None)
    if engine is not None:
        engine.shutdown()
