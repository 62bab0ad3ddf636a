"""megarl's vLLM adapter (`megarl/rollout/vllm_engine.py`) against vLLM 0.32's CPU build: one engine on a tiny
random Qwen2, every check in `checks.py`, compared with transformers' own log-probs on the same weights."""

import json

import pytest

from vllm_env import run_in_vllm_env
from helpers import make_tiny_hf_model

TOL = 1e-4  # float32 engine against float32 transformers: different kernels, same model


@pytest.fixture(scope="module")
def results(vllm_python, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    # head_dim 32: vLLM's CPU attention takes head sizes 32, 64, 80, ... (not the default tiny model's 16)
    model = make_tiny_hf_model(d / "model", "qwen2", with_tokenizer=True, num_attention_heads=2, num_key_value_heads=1)
    out = d / "results.json"
    run_in_vllm_env(vllm_python, ["tests/vllm_cpu/checks.py",
                                  str(model), str(out)], d / "checks.log")
    return json.loads(out.read_text())


def value(results, name):
    r = results[name]
    if not r["ok"]:
        pytest.fail(f"check {name} failed in the vLLM environment:\n{r['error']}", pytrace=False)
    return r["value"]


def test_greedy_generation_matches_transformers(results):
    v = value(results, "generate_greedy")
    assert v["tokens"] == v["hf_tokens"]
    assert v["max_logprob_diff"] < TOL
    assert v["finish"] == ["length"] * 3


def test_sampled_generation_logprobs_at_temperature(results):
    v = value(results, "generate_sampled")
    assert v["sizes"] == [3, 3, 3] and all(n == 12 for g in v["lengths"] for n in g)
    assert v["max_logprob_diff"] < TOL  # log_softmax(logits / T) at the sampled tokens
    assert v["seeded_same"]


def test_stop_token_is_the_last_token(results):
    v = value(results, "stop_token")
    assert v["tokens"] == v["expected"] and v["finish"] == "stop"


def test_score_and_topk_match_transformers(results):
    v = value(results, "score")
    assert v["lengths_ok"] and v["max_logprob_diff"] < TOL
    assert v["topk_ids_same"] and v["topk_max_diff"] < TOL


def test_weight_update_round_trip(results):
    v = value(results, "weight_round_trip")
    assert v["buckets"] > 1  # several buckets, delivered in one reload
    assert v["changed"], "new weights changed neither tokens nor log-probs"
    assert v["diff_vs_hf_new"] < TOL, "the engine does not compute with the weights it was sent"
    assert v["restored_exact"], "restoring the original weights did not give back the same tokens and log-probs"
    assert v["versions"] == [2]


def test_sleep_is_a_no_op_on_cpu(results):
    v = value(results, "sleep_wake")
    assert v["same_after"] and not v["colocated"]


def test_truncated_sampling_is_refused(results):
    assert "top-k / top-p" in value(results, "truncation_refused")


def test_unsupported_head_size_refused_at_launch(results):
    assert "head size is 16" in value(results, "head_size_refused")


def test_a_dead_or_hung_engine_is_restarted_with_its_weights(results):
    """vLLM's CPU engine watched as SGLang's is: its processes SIGKILLed after a sync, the same greedy tokens from
    the restarted engine holding the synced weights; SIGSTOPped with no restart left, the run stops naming it."""
    v = value(results, "restart")
    assert v["weights_matter"] and v["tokens_same"] and v["logprob_diff"] < TOL
    assert v["restarts"] == 1 and v["version"] == 1 and v["new_pids"]
    assert v["stopped"] and v["stopped"].startswith("the vLLM engine stopped the run after 1 restart(s) "
                                                    "(--engine-max-restarts 1); its last error: the vLLM engine "
                                                    "(engine core and worker pids ")
    assert "is hung" in v["stopped"] and 3.0 <= v["stop_s"] < 30, v
    print(f"vLLM CPU engine: SIGKILL answered after {v['crash_s']} s (relaunch included), SIGSTOP stopped the run "
          f"after {v['stop_s']} s")
