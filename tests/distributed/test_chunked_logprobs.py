"""Chunked log-probs and entropy from the hidden states (`megarl.mcore.chunked_logprobs`, --logprob-chunk-tokens)
against today's head (full logits, then `actor.label_logprobs` / `actor.position_entropy`): values and gradients
with respect to the hidden states and the output weight within 1e-6 (fp32, relative to the largest value), at TP 1
in this process and TP 2 under torchrun, where a tiny MegatronPolicy's log-probs and one training step on a loss
of log-probs and entropy are compared too, and at CP 2 in the same two processes
(tests/distributed/chunked_logprobs_worker.py)."""

from __future__ import annotations

import json

import pytest
from chunked_logprobs_worker import compare_cases
from helpers import REPO, torchrun

pytestmark = [pytest.mark.distributed]

CASES = ("temperature_padding_entropy", "logprobs_only_no_padding", "one_chunk_temperature_0")
PARTS = ("logp", "entropy", "grad_hidden", "grad_weight")


def _check_cases(out: dict) -> None:
    for case in CASES:
        assert out[f"{case}_grad_weight_norm"] > 1.0, f"{case}: the gradient must not be trivially zero"
        for part in PARTS:
            assert out[f"{case}_{part}"] <= 1e-6, f"{case} {part}: {out[f'{case}_{part}']}"


def test_chunked_equals_full_logits_at_tp1(one_rank_group):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.mcore import cpu_compat

    cpu_compat.install()
    parallel_state.initialize_model_parallel()
    try:
        _check_cases(compare_cases(parallel_state.get_tensor_model_parallel_group()))
        assert dist.get_world_size() == 1
    finally:
        parallel_state.destroy_model_parallel()


def test_the_planner_predicts_the_measured_head_peak(one_rank_group, monkeypatch):
    """tools/bench/logprob_memory.py's measurement (meta device: shapes only) of a small case against
    `megarl.planner.logprob_head_bytes`, both heads, TP 1 and 2, within 15 %; and the chunked head's peak does not grow
    with the tokens."""
    import importlib.util

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.mcore import cpu_compat
    from megarl.planner import logprob_head_bytes

    spec = importlib.util.spec_from_file_location("logprob_memory", REPO / "tools/bench/logprob_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cpu_compat.install()
    parallel_state.initialize_model_parallel()
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: None)  # one rank of TP 2 (as the bench)
    try:
        vocab, hidden, chunk = 8192, 32, 128
        for tp in (1, 2):
            for tokens in (192, 512, 1024):  # 192: between one and two chunks
                for c in (0, chunk):
                    measured = bench.measure("chunked" if c else "full", tokens, tp, vocab, hidden, chunk,
                                             "meta")["extra"]
                    predicted = logprob_head_bytes(tokens, vocab, hidden, tp=tp, chunk_tokens=c)
                    assert abs(predicted - measured) <= 0.15 * measured, (tp, tokens, c, predicted, measured)
        small, large = (bench.measure("chunked", n, 1, vocab, hidden, chunk, "meta")["extra"] for n in (512, 2048))
        # Per token the chunked head keeps at most three fp32 hidden-sized vectors (the hidden states, their
        # gradient, a copy around the matmul) and a few scalars; the full head adds 4 x vocab bytes (32 KiB) a token.
        assert large - small < 4 * 1536 * (3 * hidden + 16), "only per-token numbers grow with the tokens"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One torchrun of two processes for both tests below: TP 2, then CP 2 (chunked_logprobs_worker.py)."""
    out = tmp_path_factory.mktemp("chunked")
    torchrun(2, "tests/distributed/chunked_logprobs_worker.py", "--out", out, timeout=240)
    return [json.loads((out / f"chunked-rank{r}.json").read_text()) for r in range(2)]


def test_chunked_equals_full_logits_at_tp2_and_in_a_training_step(two_ranks):
    for out in two_ranks:
        _check_cases(out)
        for tied in ("tied", "untied"):
            assert out[f"policy_{tied}_step_moved"] > 1e-2, "the step must change the log-probs"
            for what in ("logprobs", "after_step", "grad_norm", "entropy"):
                assert out[f"policy_{tied}_{what}"] <= 1e-5, f"{tied} {what}: {out[f'policy_{tied}_{what}']}"


def test_chunked_equals_full_logits_at_cp2(two_ranks):
    """The actor's head at CP 2 on CP-split hidden states (temperature 0.7, vocabulary 37 padded to 40): chunked
    against today's path, and both against today's head at CP 1 on the whole sequences, within 1e-6."""
    for out in two_ranks:
        assert out["cp2_grad_weight_norm"] > 1.0, "the gradient must not be trivially zero"
        for part in PARTS:
            for what in ("cp2", "cp2_full_vs_cp1", "cp2_chunked_vs_cp1"):
                assert out[f"{what}_{part}"] <= 1e-6, f"{what} {part}: {out[f'{what}_{part}']}"
