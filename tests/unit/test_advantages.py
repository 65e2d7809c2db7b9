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


def test_group_scaling_pays_a_format_only_difference_as_much_as_a_right_answer():
    """How a small format reward can take a run over (docs/reproducibility.md): with the demo's
    rewards a right boxed answer earns 1.7 and a wrong boxed one 0.2. Divided by its own group's
    std, a group where every answer is wrong and half are boxed pushes the boxed-wrong
    completions up exactly as hard as a group with right answers pushes those; divided by the
    batch std, the 0.2 difference stays a fifth of what a right answer gets."""
    right_group = [1.7, 1.7, 1.7, 1.7, 0.0, 0.0, 0.0, 0.0]  # half right and boxed, half wrong unboxed
    wrong_group = [0.2, 0.2, 0.2, 0.2, 0.0, 0.0, 0.0, 0.0]  # all wrong, half boxed
    rewards = torch.tensor([right_group, wrong_group])
    by_group, by_batch = group_advantages(rewards, "group"), group_advantages(rewards, "batch")
    assert by_group[1, 0].item() == pytest.approx(by_group[0, 0].item(), rel=1e-3)
    assert by_batch[1, 0].item() == pytest.approx(by_batch[0, 0].item() * 0.2 / 1.7, rel=1e-6)


def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_the_float_rounding():
    """Eight completions that each earn the demo's 0.5 + 1.0 + 0.2 = 1.7: in float32 their mean
    is an ulp off 1.7, and centring alone gave each one +0.0012 (divided by a std of ~1e-7 + eps),
    so the group was trained on instead of being left out of the update. Every estimator that
    centres on a group baseline must give exactly 0 there, keep NaN for unscored completions,
    and leave a group that differs alone."""
    from plait.algo.advantages import ESTIMATORS, weighted_total

    per_reward = torch.tensor([[[1.0] * 8], [[1.0] * 8], [[1.0] * 8]])  # [rewards, groups, n]
    total = weighted_total(per_reward, torch.tensor([0.5, 1.0, 0.2]))
    assert total.mean() != total[0, 0]  # float32's mean is off by an ulp: the case this test is about
    nan = float("nan")
    rewards = torch.cat([total, torch.tensor([[0.7, 0.7, nan, 0.7, 0.7, 0.7, 0.7, 0.7]]), total * 0 + 0.3])
    rewards[2, 0] = 1.3  # this group differs
    lengths = torch.full_like(rewards, 5.0)
    for name in ("grpo", "rloo", "opo", "reinforce_pp_baseline"):
        for scale in ("group", "none"):
            a = ESTIMATORS[name](rewards, lengths, scale)
            assert torch.equal(a[0], torch.zeros(8)), (name, scale, a[0])
            assert torch.equal(a[1, [0, 1, 3, 4, 5, 6, 7]], torch.zeros(7)) and a[1, 2].isnan(), (name, scale)
            assert (a[2] != 0).all(), (name, scale)
    assert torch.equal(group_advantages(total, "batch"), torch.zeros_like(total))
