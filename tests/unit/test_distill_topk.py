"""On-policy distillation's top-K KL as the actor's loss term (`--distill-topk`): the wired loss (the actor's
vocab-parallel head, then `make_loss_fn`) and its gradient in the student's logits against a float64 hand
computation at TP 1 (tests/distributed/test_teacher.py holds TP 2 to the same numbers); a teacher's vocab-parallel
top-K; the flag's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distill_topk_checks import REAL, case, chunked_vs_full, hand, wired_loss

from megarl.errors import ConfigError


def test_wired_topk_loss_and_gradient_match_a_float64_hand_computation(process_group):
    c = case(seed=0)
    logits = c["logits"].float().requires_grad_(True)
    loss, metrics = wired_loss(logits, c)
    loss.backward()
    want_loss, want_grad, want_kl = hand(c)
    assert abs(loss.item() - want_loss) < 1e-6 * max(1.0, abs(want_loss))
    err = np.abs(logits.grad.double().numpy() - want_grad).max()
    assert err < 1e-6, f"gradient differs from the hand computation by {err}"
    assert not logits.grad[..., REAL:].any(), "vocabulary padding got a gradient"
    kl = float(metrics["distill_topk_kl_sum"] / metrics["distill_topk_tokens"])
    assert kl == pytest.approx(want_kl, rel=1e-6) and kl > 0


def test_chunked_head_gives_the_full_heads_topk_logprobs_and_gradients_at_tp1(process_group):
    from megatron.core import parallel_state

    diffs = chunked_vs_full(1, 0, parallel_state.get_tensor_model_parallel_group())
    for key, diff in diffs.items():
        if key.endswith("_grad_weight_norm"):
            assert diff > 1.0, f"{key}: the gradient must not be trivially zero"
        else:
            assert diff <= 1e-6, f"chunked vs full {key}: {diff}"


def test_vocab_parallel_topk_at_tp1_is_torch_topk_of_the_log_softmax(process_group):
    from megarl.mcore.actor import vocab_parallel_topk

    c = case(seed=1)
    logits = c["logits"].float()
    ids, logp = vocab_parallel_topk(logits, 5, 0.7, REAL)
    want_logp, want_ids = torch.log_softmax(logits[..., :REAL] / 0.7, dim=-1).topk(5, dim=-1)
    assert torch.equal(ids, want_ids)
    assert (logp - want_logp).abs().max().item() < 1e-6


def test_distill_topk_flag_errors(tmp_path):
    from types import SimpleNamespace

    from helpers import make_tiny_hf_model

    from megarl.arguments import parse_args
    from megarl.config import AlgorithmConfig
    from megarl.teacher import HTTPTeacher, serve_teacher
    from megarl.trainer.build import build_teacher

    with pytest.raises(ConfigError, match="--distill-topk must be >= 0"):
        AlgorithmConfig(distill_topk=-1)
    with pytest.raises(ConfigError, match="--distill-topk 4 needs --teacher"):
        parse_args(["recipes/tiny_cpu.sh", "--distill-topk", "4"], check_registries=False)
    cfg = parse_args(["recipes/tiny_cpu.sh", "--teacher", "http://127.0.0.1:1", "--distill-coef", "0.1",
                      "--distill-topk", "4", "--logprob-chunk-tokens", "64"], check_registries=False)
    assert cfg.algorithm.distill_topk == 4 and cfg.model.logprob_chunk_tokens == 64  # both heads compute it

    # K larger than the teacher's vocabulary: refused before the teacher is built.
    student = make_tiny_hf_model(tmp_path / "s", with_tokenizer=True)
    teacher = make_tiny_hf_model(tmp_path / "t", seed=3, with_tokenizer=True)
    vocab = 96
    bad = SimpleNamespace(model=SimpleNamespace(teacher=str(teacher), hf_checkpoint=str(student),
                                                make_vocab_size_divisible_by=1),
                          training=SimpleNamespace(distributed_timeout_seconds=60),
                          algorithm=SimpleNamespace(distill_topk=vocab + 1))
    with pytest.raises(ConfigError, match=f"--distill-topk {vocab + 1} is larger than .* vocabulary of {vocab}"):
        build_teacher(bad, SimpleNamespace(tp_size=1), {}, lambda *a: None)

    # A served teacher without top-K log-probs: refused at start, naming the flag.
    server = serve_teacher(lambda rows, temperature: [[0.0] * (len(r) - 1) for r in rows])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        served = SimpleNamespace(model=SimpleNamespace(teacher=url, hf_checkpoint=str(student)),
                                 training=SimpleNamespace(distributed_timeout_seconds=60),
                                 algorithm=SimpleNamespace(distill_topk=4))
        with pytest.raises(ConfigError, match=f"--distill-topk 4: teacher {url} refused a top-k"):
            build_teacher(served, SimpleNamespace(tp_size=1), {}, lambda *a: None)
        assert HTTPTeacher(url).logprobs(torch.tensor([[1, 2, 3]])).shape == (1, 2)  # plain log-probs still work
    finally:
        server.shutdown()
