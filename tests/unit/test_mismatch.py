"""`--mismatch-check-interval`: the full-distribution metrics against independent computations (torch's kl_div,
an elementwise TV), the top-k bounds against the full values, SGLang's top-k answer parsed from a fake, the
built-in engine's distributions against `transformers`' (fp32: KL ~0; bf16: KL > 0), and the check off by default.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.algorithms.mismatch import full_mismatch, topk_mismatch
from megarl.rollout.base import EngineCapabilities


def _two(seed: int, n: int = 7, v: int = 11, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    e = a + spread * torch.randn(n, v, generator=g, dtype=torch.float64)
    return torch.log_softmax(e, -1), torch.log_softmax(a, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_metrics_equal_independent_references(seed):
    e, a = _two(seed)
    m = full_mismatch(e, a)
    kl_fwd = F.kl_div(a, e, log_target=True, reduction="none").sum(-1)  # KL(engine || actor)
    kl_rev = F.kl_div(e, a, log_target=True, reduction="none").sum(-1)
    tv = [0.5 * sum(abs(x - y) for x, y in zip(pe, pa)) for pe, pa in zip(e.exp().tolist(), a.exp().tolist())]
    assert m["mismatch_kl_fwd"] == pytest.approx(float(kl_fwd.mean()), rel=1e-12)
    assert m["mismatch_kl_rev"] == pytest.approx(float(kl_rev.mean()), rel=1e-12)
    assert m["mismatch_tv"] == pytest.approx(sum(tv) / len(tv), rel=1e-12)
    assert m["mismatch_top1"] == pytest.approx(float((e.argmax(-1) == a.argmax(-1)).double().mean()))
    worst = int(kl_fwd.argmax())
    assert (m["mismatch_worst1_pos"], m["mismatch_worst1_kl_fwd"]) == (worst, pytest.approx(float(kl_fwd.max())))
    assert m["mismatch_worst1_kl_fwd"] >= m["mismatch_worst2_kl_fwd"] >= m["mismatch_worst3_kl_fwd"]
    same = full_mismatch(a, a)
    assert same["mismatch_kl_fwd"] == same["mismatch_tv"] == 0 and same["mismatch_top1"] == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_topk_bounds_bracket_the_full_values_and_are_exact_at_k_equal_vocab(seed):
    e, a = _two(seed)
    full = full_mismatch(e, a)
    ids = e.argsort(-1, descending=True)
    exact = topk_mismatch(ids, e.gather(1, ids), a)
    for k in ("mismatch_kl_fwd", "mismatch_kl_rev", "mismatch_tv", "mismatch_top1"):
        assert exact[k] == pytest.approx(full[k], rel=1e-9, abs=1e-12)
    assert exact["mismatch_remaining_mass"] == pytest.approx(0, abs=1e-12)
    top = ids[:, :3]
    bounded = topk_mismatch(top, e.gather(1, top), a)
    assert 0 < bounded["mismatch_kl_fwd"] <= full["mismatch_kl_fwd"]
    assert 0 < bounded["mismatch_kl_rev"] <= full["mismatch_kl_rev"]
    assert bounded["mismatch_tv"] <= full["mismatch_tv"] <= bounded["mismatch_tv_upper"]
    assert bounded["mismatch_top1"] == full["mismatch_top1"]
    rest = 1 - e.exp().gather(1, top).sum(-1)
    assert bounded["mismatch_remaining_mass"] == pytest.approx(float(rest.mean()), rel=1e-12)


class _TopkSGLang:
    """An `sglang.Engine` stand-in that answers `top_logprobs_num` requests from a known distribution."""

    def __init__(self, logp: torch.Tensor):
        self.logp, self.calls = logp, []

    def generate(self, input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num):
        self.calls.append((sampling_params["temperature"], logprob_start_len, top_logprobs_num))
        out = []
        for seq in input_ids:
            entries = [None]
            for j in range(1, len(seq)):
                order = self.logp[j - 1].argsort(descending=True)[:top_logprobs_num]
                entries.append([(float(self.logp[j - 1, t]), int(t), None) for t in order])
            out.append({"meta_info": {"input_top_logprobs": entries}})
        return out


def test_sglang_topk_answer_feeds_the_bounded_check():
    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.stages.mismatch import ActorSide, engine_side

    e, a = _two(3, n=5, v=9)
    fake = _TopkSGLang(e)
    engine = SGLangEngine(fake, serialize=lambda b, tp: [b])
    cols = torch.tensor([1, 2, 4])  # the sampled positions of a 6-token row
    side = ActorSide([[0, 1, 2, 3, 4, 5]], [cols], [a[cols].float()])
    got = engine_side(engine, side, topk=4)
    top = e[cols].argsort(-1, descending=True)[:, :4]
    where = torch.stack([torch.zeros_like(cols), cols], dim=-1)  # (row, column) of each position
    want = topk_mismatch(top, e[cols].gather(1, top), a[cols].float(), where)
    assert fake.calls == [(1.0, 0, 4)] and got["mismatch_bounded"] == 1.0
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k


def test_builtin_engine_distributions_against_transformers(tiny_qwen2):
    """fp32 engine against `transformers`' fp32 distribution: KL below 1e-6; a bf16 engine: strictly positive, and
    well above the fp32 engine's."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.builtin import BuiltinEngine
    from megarl.stages.mismatch import ActorSide, engine_side

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2).float().eval()
    seqs = [[3, 17, 5, 9, 22, 40, 7], [11, 2, 30, 8]]
    cols = [torch.tensor([2, 3, 4, 5]), torch.tensor([1, 2])]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1].float(), -1) for s in seqs]
    side = ActorSide(seqs, cols, [r[c] for r, c in zip(ref, cols)])
    fp32 = engine_side(BuiltinEngine.from_pretrained(tiny_qwen2), side, topk=5)
    bf16 = engine_side(BuiltinEngine.from_pretrained(tiny_qwen2, dtype=torch.bfloat16), side, topk=5)
    assert fp32["mismatch_bounded"] == 0 and fp32["mismatch_positions"] == 6
    assert fp32["mismatch_kl_fwd"] < 1e-6 and fp32["mismatch_kl_rev"] < 1e-6 and fp32["mismatch_top1"] == 1
    # The tiny random model's distributions are near uniform: bf16 moves them by ~1e-7 nats, fp32 by ~1e-12.
    assert bf16["mismatch_kl_fwd"] > 10 * fp32["mismatch_kl_fwd"] and bf16["mismatch_kl_rev"] > 0, (bf16, fp32)
    assert bf16["mismatch_tv"] > fp32["mismatch_tv"]


def test_off_by_default_and_the_sync_takes_no_actor_side_when_off():
    from megarl.config import RolloutConfig
    from megarl.samples import PackedSamples
    from megarl.stages.colocation import WeightSync

    class Actor:
        def next_token_distributions(self, tokens):
            raise AssertionError("the check is off: no vocabulary-wide forward")

    assert RolloutConfig().mismatch_check_interval == 0
    sync = object.__new__(WeightSync)  # only the fields __call__ reads: an engine that shares the actor's weights
    sync.actor, sync.engine, sync.r, sync.shares_actor_weights = Actor(), None, RolloutConfig(), True
    sync.colocated = False
    sync.pending = sync.pending_mismatch = None
    rows = PackedSamples(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([4, 4]))
    assert sync(version=3, rows=rows) == {} and sync.pending_mismatch is None


class _Recording(EngineCapabilities):
    """An engine that keeps what it sampled and the distributions it scored, for the bench test's own reference."""

    scores_distributions = True

    def __init__(self, engine):
        self.engine, self.groups = engine, None

    def generate(self, prompts, params):
        self.groups = self.engine.generate(prompts, params)
        return self.groups

    def score_distributions(self, sequences, prompt_lens, temperature=1.0):
        self.scored = self.engine.score_distributions(sequences, prompt_lens, temperature)
        return self.scored


def test_bench_core_against_transformers_on_the_tiny_model(tiny_qwen2, process_group):
    """tools/bench/mismatch.py's `measure` (engine samples, Megatron actor, both distributions) on the tiny random
    model, against a float64 reference from `transformers`' fp32 model at the sampled positions: the full KL
    (engine || actor), the sampled-token |dlogp|, the row and position counts. fp32 engine: KL < 1e-6; bf16:
    strictly larger."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from megarl.mcore.actor import MegatronPolicy
    from megarl.model_shape import ModelShape
    from megarl.rollout.builtin import BuiltinEngine

    spec = importlib.util.spec_from_file_location(
        "bench_mismatch", Path(__file__).resolve().parents[2] / "tools" / "bench" / "mismatch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    actor = MegatronPolicy(ModelShape.from_pretrained(tiny_qwen2), tp=1, pp=1, trainable=False)
    actor.load_hf(tiny_qwen2)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2).double().eval()
    prompts = [[3, 17, 5], [11, 2], [40, 41, 42, 43]]
    got = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = _Recording(BuiltinEngine.from_pretrained(tiny_qwen2, dtype=dtype))
        got[name] = m = bench.measure(engine, actor, prompts, max_new_tokens=5, seed=0)
        kl, dlogp = [], []
        for i, (p, (c,)) in enumerate(zip(prompts, engine.groups)):
            seq = torch.tensor([p + list(c.token_ids)])
            with torch.no_grad():
                ref = torch.log_softmax(hf(seq).logits[0, len(p) - 1: -1], dim=-1)  # [response, vocab]
            # Scored from prompt length 1: row j predicts token j + 1; renormalised as the definition says
            eng = torch.log_softmax(engine.scored[i][len(p) - 1:].double(), dim=-1)
            kl.append((eng.exp() * (eng - ref)).sum(-1))
            dlogp.append((ref.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
                          - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
        kl, dlogp = torch.cat(kl), torch.cat(dlogp)
        assert m["mismatch_rows"] == 3 and m["mismatch_positions"] == kl.numel() == 15, m  # no stop token in 5
        assert m["mismatch_kl_fwd"] == pytest.approx(float(kl.mean()), rel=0.05, abs=1e-9), name
        assert m["sampled_abs_dlogp"] == pytest.approx(float(dlogp.mean()), rel=0.01, abs=1e-6), name
    assert got["fp32"]["mismatch_kl_fwd"] < 1e-6 and got["fp32"]["sampled_abs_dlogp"] < 1e-5
    assert got["bf16"]["mismatch_kl_fwd"] > 10 * got["fp32"]["mismatch_kl_fwd"]
    assert got["bf16"]["sampled_abs_dlogp"] > 10 * got["fp32"]["sampled_abs_dlogp"]
