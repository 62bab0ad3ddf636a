"""On-policy distillation's teacher (`--teacher`): built as the trainer builds it (a wider model than the student,
TP 1 and TP 2 on gloo), its log-probs equal `transformers`' own model's on the same ids; a remote teacher served over
HTTP (SGLang's prompt log-prob shape) gives the local teacher's; a teacher with another tokenizer is refused."""

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
    got = [torch.load(out / f"teacher-rank{r}.pt", weights_only=False)["logprobs"] for r in range(nproc)]
    for g in got[1:]:  # every TP rank holds the same log-probs
        assert torch.equal(g, got[0])
    return got[0]


def test_teacher_logprobs_match_transformers_at_tp1_and_tp2_and_remote_teacher_matches(models, tmp_path):
    from megarl.teacher import HTTPTeacher, hf_scorer, serve_teacher

    student, teacher = models
    _, want = hf_reference(teacher, temperature=0.7)
    local = {}
    for nproc, tp in ((1, 1), (2, 2)):
        local[tp] = _teacher_logprobs(student, teacher, tmp_path / f"tp{tp}", nproc, tp)
        err = (local[tp] - want).abs().max().item()
        assert err < 1e-5, f"TP {tp}: teacher log-probs differ from transformers' by {err}"

    server = serve_teacher(hf_scorer(str(teacher)))
    try:
        remote = HTTPTeacher(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=60, max_rows=3)
        tokens = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1234))
        lengths = torch.tensor([12, 12, 9, 12])
        got = remote.logprobs(tokens, lengths=lengths, temperature=0.7)
    finally:
        server.shutdown()
    full = torch.ones(4, dtype=torch.bool)
    full[2] = False
    assert (got[full] - local[1][full]).abs().max().item() < 1e-5
    # The short row: its own log-probs (it is scored without its padding), 0 past its length.
    assert torch.equal(got[2, 8:], torch.zeros(3))
    assert (got[2, :8] - local[1][2, :8]).abs().max().item() < 1e-5


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
