import math

import pytest
import torch

from plait.algo.advantages import EPS, group_advantages


REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])


def test_group_scaling_by_hand():
    a = group_advantages(REWARDS, "group")
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    expect = 0.5 / (std + EPS)
    assert torch.allclose(a[0], torch.tensor([expect, -expect, -expect, expect]))
    assert torch.equal(a[1], torch.zeros(4))  # all-equal group teaches nothing


def test_batch_scaling_by_hand():
    a = group_advantages(REWARDS, "batch")
    values = [1, 0, 0, 1, 2, 2, 2, 2]
    mean = sum(values) / 8
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 7)
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + EPS))
    assert torch.equal(a[1], torch.zeros(4))


def test_no_scaling_is_centred_rewards():
    a = group_advantages(REWARDS, "none")
    assert torch.equal(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))


def test_advantages_sum_to_zero_per_group():
    r = torch.randn(5, 8)
    for scale in ("group", "batch", "none"):
        assert torch.allclose(group_advantages(r, scale).sum(1), torch.zeros(5), atol=1e-5)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="groups, num_generations"):
        group_advantages(torch.zeros(4), "group")
    with pytest.raises(ValueError, match="scale"):
        group_advantages(REWARDS, "sometimes")
