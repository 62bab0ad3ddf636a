"""The built-in rollout engine against `transformers`' own Llama / Qwen2 / Qwen3 / Qwen3-MoE on tiny random
checkpoints (Qwen3-MoE: 4 experts, top-2, renormalised, with a dense layer; and without renormalisation).

Checks: log-probs from `score` equal HF's, greedy decoding equals HF `generate`, sampled log-probs equal a
re-score, stop / length finishing, seeding, top_k=1 == greedy, clear `update_weights` errors, and group order.
"""

from __future__ import annotations

import pytest
import torch

from megarl.model_shape import ModelShape
from megarl.rollout.base import RolloutEngine, SamplingParams
from megarl.rollout.builtin import BuiltinEngine

transformers = pytest.importorskip("transformers")

VOCAB = 96
PROMPTS = [[5, 17, 33, 2, 8, 90, 41], [12, 7], [60, 61, 62, 63, 1]]  # different lengths: exercises left padding


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded machine OpenMP barriers make them 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _save_tiny_model(path, family: str, tied: bool) -> torch.nn.Module:
    """A tiny random HF model saved to `path`; returned in eval mode as the reference."""
    config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                  "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
                  "qwen3_moe_plain": transformers.Qwen3MoeConfig, "deepseek_v3": transformers.DeepseekV3Config,
                  "deepseek_v3_yarn": transformers.DeepseekV3Config}[family]
    extra = {}
    if family.startswith("qwen3"):
        extra = dict(head_dim=24)  # not hidden / heads: the explicit head_dim is read
    if family.startswith("qwen3_moe"):
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=family == "qwen3_moe", mlp_only_layers=[1] if family == "qwen3_moe" else [])
    rope = {"rope_type": "default", "rope_theta": 1000.0}  # not the default, so theta is read
    if family.startswith("deepseek_v3"):  # MLA; 4 experts, 2 groups (one searched), a shared expert
        extra = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                     v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5)
    if family == "deepseek_v3_yarn":  # a full-rank query, no groups, YaRN
        extra.update(q_lora_rank=None, n_group=1, topk_group=1)
        rope.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.8,
                    mscale_all_dim=1.0)
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,  # HF would stop (and min_new_tokens would mask) at Llama's default eos 2
        rope_parameters=rope,
        **{"num_key_value_heads": 2, **extra},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF's init (std 0.02) gives near-uniform logits: greedy would hinge on rounding ties
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
            elif "q_norm" in name or "k_norm" in name or "a_layernorm" in name:  # ones would hide a mix-up
                param.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias: zeros would not steer
                buf.normal_(0, 0.2)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=[("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True),
                                        ("qwen3", True), ("qwen3", False), ("qwen3_moe", False),
                                        ("qwen3_moe_plain", True), ("deepseek_v3", False), ("deepseek_v3_yarn", True)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def models(request, tmp_path_factory):
    family, tied = request.param
    path = tmp_path_factory.mktemp(f"{family}_{tied}")
    hf = _save_tiny_model(path, family, tied)
    return hf, BuiltinEngine.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    hf = _save_tiny_model(path, "qwen2", False)
    return hf, BuiltinEngine.from_pretrained(path)


def _hf_logprobs(hf, seq: list[int], prompt_len: int) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, seq[i]].item() for i in range(prompt_len, len(seq))]


def test_is_a_rollout_engine(qwen):
    assert isinstance(qwen[1], RolloutEngine)


def test_score_matches_hf(models):
    hf, engine = models
    seqs = [p + [3, 9, 27, 81, 50] for p in PROMPTS]
    prompt_lens = [len(p) for p in PROMPTS]
    ours = engine.score(seqs, prompt_lens)
    for seq, plen, got in zip(seqs, prompt_lens, ours):
        want = _hf_logprobs(hf, seq, plen)
        assert len(got) == len(want) == len(seq) - plen
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_greedy_matches_hf_generate(models):
    hf, engine = models
    max_new = 12
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=max_new))
    for prompt, group in zip(PROMPTS, out):
        # HF one prompt at a time: no padding on its side, so any padding bug on ours shows.
        want = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, pad_token_id=0
        )[0, len(prompt):].tolist()
        assert group[0].token_ids == want
        assert group[0].finish_reason == "length"


def test_sampled_logprobs_equal_rescore(models):
    _, engine = models
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=10, seed=3)
    groups = engine.generate(PROMPTS, params)
    seqs, plens, want = [], [], []
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) == 10
            seqs.append(list(prompt) + c.token_ids)
            plens.append(len(prompt))
            want.append(c.logprobs)
    got = engine.score(seqs, plens, temperature=0.7)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_stop_and_length(qwen):
    _, engine = qwen
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    stop = greedy[0][0].token_ids[3]  # prompt 0 will emit it at step 3 (or earlier, if it repeats)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)))
    for full, group in zip(greedy, out):
        c, tokens = group[0], full[0].token_ids
        if stop in tokens:
            cut = tokens.index(stop) + 1
            assert (c.finish_reason, c.token_ids, c.token_ids[-1]) == ("stop", tokens[:cut], stop)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(full[0].logprobs[:cut]))
        else:
            assert (c.finish_reason, c.token_ids) == ("length", tokens)
    assert out[0][0].finish_reason == "stop" and len(out[0][0].token_ids) <= 4


def test_stops_with_compaction_keep_rows_apart(qwen):
    """Many rows ending at different steps force batch compaction; each row must still match its own decode."""
    _, engine = qwen
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=16, seed=11, stop_token_ids=tuple(range(0, VOCAB, 6)))
    batched = engine.generate(PROMPTS, params)
    reasons = {c.finish_reason for g in batched for c in g}
    assert reasons == {"stop", "length"}
    for prompt, group in zip(PROMPTS, batched):
        for c in group:
            assert all(t not in params.stop_token_ids for t in c.token_ids[:-1])
            rescored = engine.score([list(prompt) + c.token_ids], [len(prompt)])[0]
            torch.testing.assert_close(torch.tensor(rescored), torch.tensor(c.logprobs), atol=1e-4, rtol=0)


def test_seeding(qwen):
    _, engine = qwen
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=8))

    def ids(groups):
        return [c.token_ids for g in groups for c in g]

    assert ids(first) == ids(again)
    assert ids(first) != ids(other)
    assert len({tuple(t) for t in ids(first)}) > 1  # the n samples of a prompt differ


def test_top_k_one_is_greedy(qwen):
    _, engine = qwen
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    top1 = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=10, seed=1))
    for g, t in zip(greedy, top1):
        assert t[0].token_ids == t[1].token_ids == g[0].token_ids


def test_update_weights_errors_and_version(qwen):
    _, engine = qwen
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight.*\(64, 64\).*\(32, 64\)"):
        engine.update_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))])
    engine.update_weights([], version=5)
    assert engine.weight_version == 5
    before = engine.score([PROMPTS[0]], [1])
    bias = engine._params["model.layers.0.self_attn.v_proj.bias"].clone()
    engine.update_weights([("model.layers.0.self_attn.v_proj.bias", bias + 1.0)])  # a subset; version + 1
    assert engine.weight_version == 6
    assert engine.score([PROMPTS[0]], [1]) != before
    engine.update_weights([("model.layers.0.self_attn.v_proj.bias", bias)], version=7)
    assert engine.score([PROMPTS[0]], [1]) == before
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))[0][0].weight_version == 7


def test_groups_in_prompt_order(qwen):
    _, engine = qwen
    n = 3
    out = engine.generate(PROMPTS, SamplingParams(n=n, temperature=0, max_new_tokens=6))
    assert [len(g) for g in out] == [n] * len(PROMPTS)
    for prompt, group in zip(PROMPTS, out):
        alone = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))[0][0]
        assert all(c.token_ids == alone.token_ids for c in group)


def test_config_parsing():
    base = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert ModelShape.from_hf_config({**base, "rope_theta": 500.0}).rope_theta == 500.0  # transformers < 5
    default = {"rope_type": "default", "rope_theta": 7.0}
    assert ModelShape.from_hf_config({**base, "rope_parameters": default}).rope_theta == 7.0
    assert ModelShape.from_hf_config(base).qkv_bias is False
    assert ModelShape.from_hf_config({**base, "model_type": "qwen2"}).qkv_bias is True
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        ModelShape.from_hf_config({**base,
                                   "rope_parameters": {"rope_type": "dynamic", "rope_theta": 7.0, "factor": 8.0}})
    with pytest.raises(ValueError, match="model_type"):
        ModelShape.from_hf_config({**base, "model_type": "gpt2"})


def test_bf16_packed_weights_give_the_same_results_and_follow_updates(tmp_path):
    """bf16 on CPU multiplies through oneDNN-packed weights: bitwise what F.linear gives, and re-packed when the
    weights change (a stale packed copy would keep sampling from the old policy)."""
    path = tmp_path / "qwen"
    _save_tiny_model(path, "qwen2", False)
    packed = BuiltinEngine.from_pretrained(path, dtype=torch.bfloat16)
    plain = BuiltinEngine.from_pretrained(path, dtype=torch.bfloat16)
    plain._pack = False
    if not packed._pack:
        pytest.skip("this CPU's oneDNN has no bf16 matmul")
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7)

    def same(a, b):
        for ga, gb in zip(a.generate(PROMPTS, params), b.generate(PROMPTS, params)):
            for ca, cb in zip(ga, gb):
                assert ca.token_ids == cb.token_ids and ca.logprobs == cb.logprobs
        assert a.score([PROMPTS[0] + [3, 4]], [len(PROMPTS[0])]) == b.score([PROMPTS[0] + [3, 4]], [len(PROMPTS[0])])

    same(packed, plain)
    assert packed._packed  # the packed path ran
    before = packed.generate(PROMPTS, params)
    torch.manual_seed(1)
    new = {name: torch.randn_like(t) * 0.2 for name, t in packed._params.items() if "mlp" in name or "proj" in name}
    for engine in (packed, plain):
        engine.update_weights(new.items(), version=1)
    same(packed, plain)
    assert [c.token_ids for c in packed.generate(PROMPTS, params)[0]] != [c.token_ids for c in before[0]]


class _LetterTokenizer:
    """Token i decodes to 1-3 letters (so stop strings span token boundaries); an independent decode."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("abcdefg"[i % 7] * (1 + i % 3) for i in ids)


def test_stop_strings_end_a_row_at_the_token_that_completes_them(qwen):
    _, engine = qwen
    tok = _LetterTokenizer()
    free = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    tokens = free[0][0].token_ids
    text = tok.decode(tokens)
    stop = text[len(tok.decode(tokens[:2])) + 1 : len(tok.decode(tokens[:5])) - 1]  # spans tokens 2..4, partly
    cut = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k]))  # the reference: first hit
    engine.tokenizer = tok
    try:
        out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop=(stop, "zzzz")))
    finally:
        engine.tokenizer = None
    c = out[0][0]
    assert (c.token_ids, c.finish_reason) == (tokens[:cut], "stop") and cut <= 5
    assert c.logprobs == free[0][0].logprobs[:cut]
    for got, want in zip(out[1:], free[1:]):  # other rows: cut at their own first hit, or left whole
        hit = [k for k in range(1, 13) if stop in tok.decode(want[0].token_ids[:k])]
        assert got[0].token_ids == want[0].token_ids[: hit[0] if hit else 12]
        assert got[0].finish_reason == ("stop" if hit else "length")


def test_sampled_stop_strings_with_compaction(qwen):
    _, engine = qwen
    tok = _LetterTokenizer()
    engine.tokenizer = tok
    try:
        params = SamplingParams(n=8, temperature=1.0, max_new_tokens=16, seed=5, stop=("ca", "gg"))
        groups = engine.generate(PROMPTS, params)
    finally:
        engine.tokenizer = None
    reasons = {c.finish_reason for g in groups for c in g}
    assert reasons == {"stop", "length"}
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            hit = [k for k in range(1, len(c.token_ids) + 1) if any(s in tok.decode(c.token_ids[:k])
                                                                    for s in params.stop)]
            assert hit == ([len(c.token_ids)] if c.finish_reason == "stop" else [])
            rescored = engine.score([list(prompt) + c.token_ids], [len(prompt)])[0]
            torch.testing.assert_close(torch.tensor(rescored), torch.tensor(c.logprobs), atol=1e-4, rtol=0)


def test_stop_strings_need_a_tokenizer_and_are_strings(qwen):
    with pytest.raises(ValueError, match=r"needs the engine's tokenizer.*BuiltinEngine\(\.\.\., tokenizer=\.\.\.\)"):
        qwen[1].generate(PROMPTS, SamplingParams(max_new_tokens=4, stop=("x",)))
    with pytest.raises(ValueError, match="SamplingParams.stop must be a tuple of non-empty strings"):
        SamplingParams(stop="</tool_call>")
    with pytest.raises(ValueError, match="SamplingParams.stop must be a tuple of non-empty strings"):
        SamplingParams(stop=("",))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_yarn"])
def test_deepseek_v3_logits_match_hf(family, tmp_path):
    """MLA (interleaved RoPE, low-rank or full-rank query, YaRN), DeepSeek's router and the shared expert: the
    engine's full-sequence logits equal transformers' within 1e-5 in fp32, left padding included."""
    hf = _save_tiny_model(tmp_path, family, family.endswith("yarn"))
    engine = BuiltinEngine.from_pretrained(tmp_path)
    ids, pos, pads = engine._left_pad(PROMPTS)
    width = ids.shape[1]
    with torch.inference_mode():
        ours = engine._logits(engine._forward(ids, pos, engine._prefill_mask(engine._key_mask(pads, width), width)))
        for row, prompt in enumerate(PROMPTS):
            want = hf(torch.tensor([prompt])).logits[0].float()
            diff = (ours[row, width - len(prompt):] - want).abs().max().item()
            print(f"{family} prompt {row}: max |logit - transformers| = {diff:.3g}")
            assert diff < 1e-5
