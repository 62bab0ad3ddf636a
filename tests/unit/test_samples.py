"""`to_train_batch`: samples -> the actor's right-padded training tensors, checked against tensors written out."""

from __future__ import annotations

import pytest
import torch

from megarl.samples import Sample, to_train_batch

PAD = 1


def sample(prompt, response, logprobs, advantage, group=0) -> Sample:
    return Sample(group=group, prompt_index=group, prompt_ids=list(prompt), response_ids=list(response),
                  rollout_logprobs=list(logprobs), finish_reason="stop", advantage=advantage)


@pytest.fixture
def two_samples():
    # A: prompt of 3, response of 2 (hit the length limit).  B: prompt of 2, response of 4 ending in EOS (id 0).
    a = sample([5, 6, 7], [20, 21], [-0.5, -1.5], advantage=1.0)
    b = sample([8, 9], [30, 31, 32, 0], [-0.1, -0.2, -0.3, -0.4], advantage=-0.5, group=1)
    return [a, b]


def test_two_samples_of_different_lengths(two_samples):
    batch = to_train_batch(two_samples, pad_id=PAD)
    assert set(batch) == {"tokens", "loss_mask", "rollout_logp", "advantages"}

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
    expected_adv = torch.tensor([1.0, -0.5])

    assert batch["tokens"].dtype == torch.long
    assert torch.equal(batch["tokens"], expected_tokens)
    assert batch["loss_mask"].dtype == torch.float32 and batch["loss_mask"].shape == (2, 5)
    assert torch.equal(batch["loss_mask"], expected_mask)
    assert batch["rollout_logp"].dtype == torch.float32
    assert torch.equal(batch["rollout_logp"], expected_logp)
    assert batch["advantages"].dtype == torch.float32
    assert torch.equal(batch["advantages"], expected_adv)


def test_loss_mask_marks_exactly_the_response_targets(two_samples):
    batch = to_train_batch(two_samples, pad_id=PAD)
    for b, s in enumerate(two_samples):
        targets = batch["tokens"][b, 1:]
        got = [int(t) for t, m in zip(targets, batch["loss_mask"][b]) if m == 1]
        assert got == s.response_ids
        # rollout log-probs line up with the tokens they score
        assert batch["rollout_logp"][b][batch["loss_mask"][b] == 1].tolist() == pytest.approx(s.rollout_logprobs)


def test_order_of_samples_is_kept(two_samples):
    batch = to_train_batch(list(reversed(two_samples)), pad_id=7)
    assert torch.equal(batch["tokens"], torch.tensor([[8, 9, 30, 31, 32, 0], [5, 6, 7, 20, 21, 7]]))
    assert torch.equal(batch["advantages"], torch.tensor([-0.5, 1.0]))


def test_empty_response_contributes_no_loss():
    a = sample([4, 5], [], [], advantage=2.0)
    b = sample([6], [7, 8], [-1.0, -2.0], advantage=0.0)
    batch = to_train_batch([a, b], pad_id=PAD)
    assert torch.equal(batch["tokens"], torch.tensor([[4, 5, PAD], [6, 7, 8]]))
    assert torch.equal(batch["loss_mask"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(batch["rollout_logp"], torch.tensor([[0.0, 0.0], [-1.0, -2.0]]))


def test_logprob_count_must_match_response_length():
    bad = sample([1, 2], [3, 4, 5], [-0.1, -0.2], advantage=0.0)
    with pytest.raises(RuntimeError):
        to_train_batch([bad], pad_id=PAD)

