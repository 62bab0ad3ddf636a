"""megarl's in-process SGLang adapter (`SGLangEngine`) against SGLang 0.5.23 itself on CPU, non-colocated (memory
release needs a GPU). One engine for the module (checks_engine.py, run in the SGLang environment); the tests run in
file order, each one adapter call."""

import pytest


@pytest.fixture(scope="module")
def engine(worker_for, starter, sglang_python):
    w = worker_for("checks_engine", timeout_s=300)
    w.launched = w.call("launch", model_dir=str(starter))
    return w


def test_colocated_refused_on_cpu(worker_for, starter, sglang_python):
    message = worker_for("checks_engine").call("colocated_refused", model_dir=str(starter))
    assert "cannot run colocated" in message and "torch_memory_saver" in message


def test_launch_non_colocated_says_so(engine):
    log = engine.launched["log"]
    assert engine.launched["colocated"] is False
    assert "not colocated" in log, log
    assert "seeded sampling is not reproducible" in log, log


def test_generate_with_logprobs(engine):
    assert engine.call("generate_logprobs")["max_abs_diff"] < 1e-3


def test_greedy_repeats(engine):
    engine.call("greedy_and_seed")


def test_score_probe(engine):
    assert engine.call("score")["sync_probe_absdiff_max"] < 1e-3


def test_bucketed_weight_sync_verified(engine):
    rounds = engine.call("weight_sync")["rounds"]
    assert [r["version"] for r in rounds] == [1, 2]


def test_wrong_weights_caught(engine):
    assert "weight sync check failed" in engine.call("wrong_weights_caught")["caught"]


def test_mismatch_topk(engine):
    engine.call("mismatch_topk")


def test_flush(engine):
    engine.call("flush")


def test_abort(engine):
    result = engine.call("abort")
    assert result["aborted"] == sum(r == "abort" for r in result["reasons"]) > 0, result


def test_stop_strings_and_a_second_turn(engine):
    engine.call("stop_strings")
