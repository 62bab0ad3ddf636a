"""The vLLM adapter's rules that need no engine (they run in the test venv, which has no vLLM)."""

import pytest

from megarl.rollout.backends import BACKENDS
from megarl.rollout.base import SamplingParams
from megarl.rollout.vllm_engine import check_truncation, vllm_available


def test_backend_registered_and_says_why_not_available():
    backend = BACKENDS.get("vllm")
    ok, why = vllm_available()
    got = backend.available(None)  # it reads nothing of the configuration
    if ok:
        assert got == (True, "")
    else:
        assert got[0] is False and "--rollout-backend vllm: vllm is not importable" in got[1]
        assert "--rollout-backend builtin" in got[1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=5), SamplingParams(top_p=0.9)])
def test_truncated_sampling_refused(params):
    with pytest.raises(ValueError, match="after top-k / top-p truncation"):
        check_truncation(params)


def test_greedy_and_plain_sampling_pass():
    check_truncation(SamplingParams(temperature=0.0, top_k=5))
    check_truncation(SamplingParams(temperature=0.7))
