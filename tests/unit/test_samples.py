"""Samples -> the models' right-padded rows (`pack`), checked against tensors written out by hand."""

from __future__ import annotations

import pytest
import torch

from megarl.stages.algorithm import pack
from megarl.samples import Sample, SampleStatus

PAD = 1


def sample(prompt, response, logprobs, group=0, mask=None, status=SampleStatus.COMPLETED) -> Sample:
    return Sample(group=group, prompt_index=group, prompt_ids=list(prompt), response_ids=list(response),
                  loss_mask=list(mask) if mask is not None else [1] * len(response), rollout_logprobs=list(logprobs),
                  weight_version=3, status=status)


@pytest.fixture
def two_samples():
    # A: prompt of 3, response of 2 (hit the length limit).  B: prompt of 2, response of 4 ending in EOS (id 0).
    a = sample([5, 6, 7], [20, 21], [-0.5, -1.5], status=SampleStatus.TRUNCATED)
    b = sample([8, 9], [30, 31, 32, 0], [-0.1, -0.2, -0.3, -0.4], group=1)
    return [a, b]


def test_two_samples_of_different_lengths(two_samples):
    packed = pack(two_samples, pad_id=PAD)
    # Right padding to the longest sequence (B: 2 + 4 = 6 tokens).
    expected_tokens = torch.tensor([
        [5, 6, 7, 20, 21, PAD],
        [8, 9, 30, 31, 32, 0],
    ])
    # Column t predicts tokens[:, t + 1]. A's response tokens sit at 3, 4 -> columns 2, 3;
    # B's at 2..5 -> columns 1..4 (the EOS included). The pad at A[5] is never a target.
    expected_mask = torch.tensor([
        [0.0, 0.0, 1.0, 1.0, 0.0],
        [0.0, 1.0, 1.0, 1.0, 1.0],
    ])
    expected_logp = torch.tensor([
        [0.0, 0.0, -0.5, -1.5, 0.0],
        [0.0, -0.1, -0.2, -0.3, -0.4],
    ])
    assert packed.tokens.dtype == torch.long and torch.equal(packed.tokens, expected_tokens)
    assert packed.loss_mask.dtype == torch.float32 and torch.equal(packed.loss_mask, expected_mask)
    assert packed.rollout_logp.dtype == torch.float32 and torch.equal(packed.rollout_logp, expected_logp)
    assert packed.lengths.tolist() == [5, 6]


def test_truncated_responses_leave_the_loss_only_when_asked(two_samples):
    kept, cut = pack(two_samples, PAD), pack(two_samples, PAD, mask_truncated=True)
    assert kept.loss_mask[0].sum() == 2 and cut.loss_mask[0].sum() == 0
    assert torch.equal(kept.loss_mask[1], cut.loss_mask[1]) and torch.equal(kept.rollout_logp, cut.rollout_logp)


def test_tokens_the_policy_did_not_generate_are_masked():
    # A tool call of 2 tokens, the tool's answer of 2 tokens (mask 0, log-prob 0), then 1 more token of the policy.
    s = sample([4, 5], [10, 11, 60, 61, 12], [-0.1, -0.2, 0.0, 0.0, -0.3], mask=[1, 1, 0, 0, 1])
    packed = pack([s], PAD)
    assert torch.equal(packed.loss_mask, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]]))
    assert torch.equal(packed.rollout_logp, torch.tensor([[0.0, -0.1, -0.2, 0.0, 0.0, -0.3]]))
    targets = packed.tokens[0, 1:][packed.loss_mask[0] == 1].tolist()
    assert targets == [10, 11, 12]  # exactly the policy's tokens are trained on


def test_loss_mask_marks_exactly_the_response_targets(two_samples):
    packed = pack(two_samples, pad_id=PAD)
    for b, s in enumerate(two_samples):
        targets = packed.tokens[b, 1:]
        got = [int(t) for t, m in zip(targets, packed.loss_mask[b]) if m == 1]
        assert got == s.response_ids
        assert packed.rollout_logp[b][packed.loss_mask[b] == 1].tolist() == pytest.approx(s.rollout_logprobs)


def test_order_of_samples_is_kept(two_samples):
    packed = pack(list(reversed(two_samples)), pad_id=7)
    assert torch.equal(packed.tokens, torch.tensor([[8, 9, 30, 31, 32, 0], [5, 6, 7, 20, 21, 7]]))


def test_empty_response_contributes_no_loss():
    packed = pack([sample([4, 5], [], []), sample([6], [7, 8], [-1.0, -2.0])], pad_id=PAD)
    assert torch.equal(packed.tokens, torch.tensor([[4, 5, PAD], [6, 7, 8]]))
    assert torch.equal(packed.loss_mask, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(packed.rollout_logp, torch.tensor([[0.0, 0.0], [-1.0, -2.0]]))


def test_a_sample_needs_one_mask_entry_and_log_prob_per_token():
    with pytest.raises(ValueError, match="3 tokens, 3 mask entries, 2 log-probs"):
        sample([1, 2], [3, 4, 5], [-0.1, -0.2])
    with pytest.raises(ValueError, match="2 mask entries"):
        sample([1], [3, 4, 5], [0.0] * 3, mask=[1, 1])
