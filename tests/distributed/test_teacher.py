"""On-policy distillation's teacher (`--teacher`): built as the trainer builds it (a wider model than the student,
TP 1 and TP 2 on gloo), its log-probs and top-K (`--distill-topk`) equal `transformers`' own model's on the same
ids; a remote teacher served over HTTP (SGLang's prompt log-prob shape, `input_top_logprobs` for the top-K) gives
the local teacher's; a teacher with another tokenizer is refused; the top-K KL loss term and its gradient at TP 2
equal TP 1's and a float64 hand computation."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_reference, make_tiny_hf_model, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/distributed/worker.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student = make_tiny_hf_model(root / "student", "qwen2", seed=1, with_tokenizer=True)
    teacher = make_tiny_hf_model(root / "teacher", "qwen2", seed=2, layers=3, hidden_size=96, intermediate_size=192,
                                 with_tokenizer=True)
    return student, teacher


def _teacher_logprobs(student, teacher, out, nproc, tp):
    out.mkdir()
    torchrun(nproc, WORKER, "teacher", "--hf", teacher, "--ckpt", student, "--out", out, "--tp", tp, "--pp", 1)
    ranks = [torch.load(out / f"teacher-rank{r}.pt", weights_only=False) for r in range(nproc)]
    for key in ("logprobs", "topk_ids", "topk_logp"):  # every TP rank holds the same log-probs and top-K
        for r in ranks[1:]:
            assert torch.equal(r[key], ranks[0][key])
    return ranks[0]["logprobs"], (ranks[0]["topk_ids"], ranks[0]["topk_logp"])


def test_teacher_logprobs_match_transformers_at_tp1_and_tp2_and_remote_teacher_matches(models, tmp_path):
    from megarl.teacher import HTTPTeacher, hf_scorer, serve_teacher

    student, teacher = models
    logits, want = hf_reference(teacher, temperature=0.7)
    want_top_logp, want_top_ids = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1).topk(5, dim=-1)
    local, top = {}, {}
    for nproc, tp in ((1, 1), (2, 2)):
        local[tp], top[tp] = _teacher_logprobs(student, teacher, tmp_path / f"tp{tp}", nproc, tp)
        err = (local[tp] - want).abs().max().item()
        assert err < 1e-5, f"TP {tp}: teacher log-probs differ from transformers' by {err}"
        assert torch.equal(top[tp][0], want_top_ids), f"TP {tp}: the teacher's top-5 ids differ from transformers'"
        err = (top[tp][1] - want_top_logp).abs().max().item()
        assert err < 1e-5, f"TP {tp}: the teacher's top-5 log-probs differ from transformers' by {err}"

    scorer = hf_scorer(str(teacher))
    server = serve_teacher(scorer, top=scorer.top)
    try:
        remote = HTTPTeacher(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=60, max_rows=3)
        tokens = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1234))
        lengths = torch.tensor([12, 12, 9, 12])
        got = remote.logprobs(tokens, lengths=lengths, temperature=0.7)
        got_ids, got_top = remote.topk_logprobs(tokens, 5, lengths=lengths, temperature=0.7)
    finally:
        server.shutdown()
    full = torch.ones(4, dtype=torch.bool)
    full[2] = False
    assert (got[full] - local[1][full]).abs().max().item() < 1e-5
    # The short row: its own log-probs (it is scored without its padding), 0 past its length.
    assert torch.equal(got[2, 8:], torch.zeros(3))
    assert (got[2, :8] - local[1][2, :8]).abs().max().item() < 1e-5
    # The served top-K equals the local one's, the short row's up to its length (0 past it).
    assert torch.equal(got_ids[full], top[1][0][full]) and torch.equal(got_ids[2, :8], top[1][0][2, :8])
    assert (got_top[full] - top[1][1][full]).abs().max().item() < 1e-5
    assert (got_top[2, :8] - top[1][1][2, :8]).abs().max().item() < 1e-5
    assert not got_ids[2, 8:].any() and not got_top[2, 8:].any()


def test_topk_kl_loss_and_gradient_at_tp2_equal_tp1_and_the_hand_computation_full_and_chunked(tmp_path):
    import numpy as np
    from distill_topk_checks import hand, case

    want_loss, want_grad, want_kl = hand(case(seed=0))
    got, chunks = {}, {}
    for nproc, tp in ((1, 1), (2, 2)):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        torchrun(nproc, WORKER, "topk_loss", "--hf", tmp_path, "--out", out, "--tp", tp)
        ranks = [torch.load(out / f"topk_loss-rank{r}.pt", weights_only=False) for r in range(nproc)]
        assert len({r["loss"] for r in ranks}) == 1  # every TP rank computes the same loss
        got[tp] = (ranks[0]["loss"], torch.cat([r["grad"] for r in ranks], dim=-1), ranks[0]["kl"])
        for r, rank in enumerate(ranks):
            chunks[f"{tp} rank {r}"] = rank["chunked"]
    for tp, (loss, grad, kl) in got.items():
        assert abs(loss - want_loss) < 1e-6 * max(1.0, abs(want_loss)), f"TP {tp}"
        err = np.abs(grad.double().numpy() - want_grad).max()
        assert err < 1e-6, f"TP {tp}: the gradient differs from the hand computation by {err}"
        assert kl == pytest.approx(want_kl, rel=1e-6)
    assert abs(got[2][0] - got[1][0]) < 1e-6
    assert (got[2][1] - got[1][1]).abs().max().item() < 1e-7
    for tp, chunked in chunks.items():  # --logprob-chunk-tokens' head gives the full head's top-K log-probs
        for key, diff in chunked.items():
            if key.endswith("_grad_weight_norm"):
                assert diff > 1.0, f"TP {tp} {key}: the gradient must not be trivially zero"
            else:
                assert diff <= 1e-6, f"TP {tp} chunked vs full {key}: {diff}"


def test_teacher_with_another_tokenizer_is_refused(models, tmp_path):
    from megarl.errors import ConfigError
    from megarl.teacher import check_teacher_tokenizer

    student, teacher = models
    check_teacher_tokenizer(str(student), str(teacher))  # the same tokenizer: accepted
    other = tmp_path / "other"
    other.mkdir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student)
    tok.add_tokens(["<extra_token_for_the_test>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match="--teacher .*tokenizer differs"):
        check_teacher_tokenizer(str(student), str(other))
