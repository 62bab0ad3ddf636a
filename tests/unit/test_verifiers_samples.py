"""How one episode of the verifiers process's answer becomes a `Sample` (`megarl.rollout.verifiers_env.
episode_sample`), without verifiers: the prompt is the branch's tokens before the first sampled one, the mask and
log-probs are the trace's (0 where a token was not sampled), the reward is the trace's; the last of several branches
is kept and the others counted; a failed episode is a failed sample out of the loss."""

from __future__ import annotations

import pytest

from megarl.data import PromptRecord
from megarl.errors import ConfigError
from megarl.rollout import ROLLOUTS
from megarl.rollout.slots import VerifiersOptions
from megarl.rollout.verifiers_env import VerifiersRollout, episode_sample
from megarl.samples import SampleStatus
from megarl.tasks.arithmetic import build_tokenizer

RECORD = PromptRecord(4, "1+1=", [5, 15, 5, 17], "2", "arithmetic")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def episode(branches, reward=1.0, ok=True, truncated=False):
    return {"task": 4, "reward": reward, "ok": ok, "errors": [] if ok else ["EnvError: boom"], "rewards": {},
            "branches": branches, "truncated": truncated}


def branch(ids, mask, logp):
    return {"token_ids": ids, "sampled_mask": mask, "logprobs": logp}


def test_a_multi_turn_branch_keeps_the_policys_tokens_and_masks_the_rest(tok):
    # prompt 3 tokens, the policy's 2, a tool's 2 (not sampled: their log-probs are dropped), the policy's 1
    b = branch([7, 8, 9, 20, 21, 30, 31, 0], [False] * 3 + [True, True, False, False, True],
               [0.0, 0.0, 0.0, -0.5, -0.25, -9.0, -9.0, -0.125])
    s = episode_sample(2, RECORD, episode([b], reward=0.75), 3, tok, correct_at=1.0)
    assert (s.group, s.prompt_index, s.weight_version) == (2, 4, 3)
    assert s.prompt_ids == [7, 8, 9] and s.response_ids == [20, 21, 30, 31, 0]
    assert s.loss_mask == [1, 1, 0, 0, 1] and s.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, -0.125]
    assert (s.reward, s.outcome, s.status) == (0.75, "incorrect", SampleStatus.COMPLETED)
    assert s.metadata == {"verifiers_branches_dropped": 0.0, "verifiers_failed": 0.0}


def test_the_last_branch_is_kept_and_the_others_counted(tok):
    first = branch([1, 2, 3], [False, True, True], [0.0, -1.0, -1.0])
    last = branch([4, 5, 6, 7], [False, False, True, True], [0.0, 0.0, -0.5, -0.5])
    s = episode_sample(0, RECORD, episode([first, last], truncated=True), 1, tok, correct_at=1.0)
    assert s.prompt_ids == [4, 5] and s.response_ids == [6, 7]
    assert (s.outcome, s.status, s.metadata["verifiers_branches_dropped"]) == ("correct", SampleStatus.TRUNCATED, 1.0)


def test_a_failed_episode_is_a_failed_sample_out_of_the_loss(tok):
    s = episode_sample(1, RECORD, episode([], reward=0.0, ok=False), 1, tok, correct_at=1.0)
    assert s.status is SampleStatus.FAILED and s.loss_mask == [0] and s.prompt_ids == RECORD.prompt_ids
    assert (s.reward, s.outcome, s.metadata["verifiers_failed"]) == (0.0, "no_answer", 1.0)
    assert "boom" in s.response_text


def test_a_branch_whose_lists_disagree_is_an_error(tok):
    with pytest.raises(RuntimeError, match="3 tokens, 2 mask entries"):
        episode_sample(0, RECORD, episode([branch([1, 2, 3], [False, True], [0.0, 0.0, 0.0])]), 1, tok, 1.0)


def test_options_and_a_missing_environment_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="make verifiers-env"):
        VerifiersRollout(VerifiersOptions(verifiers_taskset="x", verifiers_env=str(tmp_path)), "m")
    with pytest.raises(ConfigError, match="--verifiers-taskset"):
        VerifiersRollout(VerifiersOptions(), "m")
    with pytest.raises(ConfigError, match="--verifiers-timeout"):
        VerifiersOptions(verifiers_timeout=0)
    assert "verifiers" in ROLLOUTS


def test_the_flags_parse_and_the_taskset_is_required():
    from megarl.arguments import parse_args

    cfg = parse_args(["--rollout-function", "verifiers", "--verifiers-taskset", "mine", "--verifiers-timeout", "30"])
    options = ROLLOUTS.settings(cfg, "verifiers")
    assert (options.verifiers_taskset, options.verifiers_timeout) == ("mine", 30.0)
    with pytest.raises(ConfigError, match="--verifiers-taskset"):
        parse_args(["--rollout-function", "verifiers"])
