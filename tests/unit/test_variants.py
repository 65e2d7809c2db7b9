"""The GRPO family's variants, each against numbers worked out in the comments.

Shared example (see test_losses.py): ratios row 0 (A=+1) 1.0, 1.5, 0.5; row 1 (A=-1) 0.5,
1.5, [1.0 masked]; epsilon 0.2, epsilon_high 0.28.
"""

import math

import pytest
import torch

from plait.algo.advantages import EPS, combine_rewards, group_advantages
from plait.algo.kl import kl_k1, kl_k2, mix_reference, sequence_kl
from plait.algo.losses import LossSettings, StepCounts, engine_mismatch_weights, high_entropy_mask, policy_loss


RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
LOGP = OLD + RATIOS.log()
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
COUNTS = StepCounts(sequences=2, tokens=5, micro_batches=1, max_completion_length=4)


def settings(loss_type="dapo", **kw):
    return LossSettings(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, **kw)


def test_gspo_sequence_level_ratio():
    # s_0 = exp(mean(log 1, log 1.5, log .5)) = .75^(1/3) = 0.9086
    # s_1 = exp(mean(log .5, log 1.5)) = .75^(1/2) = 0.8660
    # both inside [0.8, 1.28]: row 0 tokens lose -s_0 each, row 1's real tokens +s_1 each
    s0, s1 = 0.75 ** (1 / 3), 0.75**0.5
    out = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings(importance_sampling_level="sequence"))
    assert float(out.loss) == pytest.approx((-3 * s0 + 2 * s1) / 5, abs=1e-6)
    assert float(out.clip_low_tokens + out.clip_high_tokens) == 0
    assert float(out.ratio_tokens) == pytest.approx(3 * s0 + 2 * s1, abs=1e-5)


def test_gspo_clips_whole_sequences():
    ratios = torch.tensor([[1.6, 1.6, 1.6]])  # s = 1.6 > 1.28 with A > 0: every token clipped
    out = policy_loss(
        ratios.log(),
        torch.zeros(1, 3),
        torch.tensor([1.0]),
        torch.ones(1, 3),
        StepCounts(1, 3, 1, 3),
        settings(importance_sampling_level="sequence"),
    )
    assert float(out.loss) == pytest.approx(-1.28, abs=1e-6) and float(out.clip_high_tokens) == 3


def test_two_sided_delta_clipping():
    # row 1 token 1 (A=-1, r=1.5): max(min(r, delta)=1.4, clip=1.28) = 1.4 instead of 1.5; row 0 unchanged
    out = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("bnpo", delta=1.4))
    assert float(out.loss) == pytest.approx((-1 - 1.28 - 0.5 + 0.8 + 1.4) / 5, abs=1e-6)
    assert float(out.delta_capped_tokens) == 1  # that one token (logged as clip/delta)


def test_cispo_clipped_weight_with_stop_gradient():
    logp = LOGP.clone().requires_grad_(True)
    out = policy_loss(logp, OLD, ADV, MASK, COUNTS, settings("cispo"))
    loss = out.loss
    w = torch.tensor([[1.0, 1.28, 0.5], [0.5, 1.28, 1.0]])  # min(r, 1 + 0.28)
    expected = (-(w * ADV[:, None] * LOGP) * MASK).sum() / 5
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    # the gradient is -w A / tokens on every real token: clipped tokens keep theirs (unlike PPO)
    assert torch.allclose(g, -w * ADV[:, None] * MASK / 5, atol=1e-6)
    assert float(out.clip_high_tokens) == 2


def test_cispo_cap_given_as_trl_gives_it():
    """TRL caps CISPO's weight at epsilon_high itself; plait's cispo_cap is that number, so
    TRL's epsilon_high=1.3 and plait's cispo_cap=1.3 are the same loss (default: 1 + 0.28)."""
    out = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("cispo", cispo_cap=1.3))
    w = torch.tensor([[1.0, 1.3, 0.5], [0.5, 1.3, 1.0]])
    assert float(out.loss) == pytest.approx(float((-(w * ADV[:, None] * LOGP) * MASK).sum() / 5), abs=1e-6)
    assert float(out.clip_high_tokens) == 2
    out = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("cispo", cispo_cap=2.0))
    assert float(out.clip_high_tokens) == 0  # 1.5 < 2: nothing capped


def test_kl_bias_correction_weights_the_kl_by_the_ratio_with_its_gradient():
    """use_bias_correction_kl (TRL, DeepSeek-V3.2): per-token KL x r, r = pi / pi_old, not detached."""
    ref = torch.zeros_like(LOGP)
    k3 = torch.exp(ref - LOGP) - (ref - LOGP) - 1
    plain = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("dapo", beta=0.5), ref).loss
    logp = LOGP.clone().requires_grad_(True)
    out = policy_loss(logp, OLD, ADV, MASK, COUNTS, settings("dapo", beta=0.5, kl_bias_correction=True), ref)
    fixed = out.loss
    assert float(out.kl_tokens) == pytest.approx(float((k3 * RATIOS * MASK).sum()), rel=1e-6)
    assert float(fixed.detach()) - float(plain) == pytest.approx(
        0.5 * float((k3 * (RATIOS - 1) * MASK).sum()) / 5, abs=1e-6
    )
    # d/dlogp of r k3 = r k3 + r (1 - exp(ref - logp)): the ratio carries gradient too
    (g,) = torch.autograd.grad(fixed, logp)
    (g_plain,) = torch.autograd.grad(
        policy_loss(logp, OLD, ADV, MASK, COUNTS, settings("dapo", beta=0.5), ref).loss, logp
    )
    kl_grad = 0.5 * (RATIOS * k3 + RATIOS * (1 - torch.exp(ref - LOGP))) * MASK / 5
    plain_kl_grad = 0.5 * (1 - torch.exp(ref - LOGP)) * MASK / 5
    assert torch.allclose(g - g_plain, kl_grad - plain_kl_grad, atol=1e-6)


def test_entropy_filtering_masks_the_policy_term_only():
    """arXiv:2506.01939 (and TRL): dropped tokens lose their policy gradient, but the KL term
    and the normalizer still count every real token."""
    keep = torch.tensor([[0, 1, 1], [1, 0, 0]])
    ref = torch.zeros_like(LOGP)
    s = settings("dapo", beta=0.5)
    loss = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, s, ref, policy_mask=keep).loss
    policy = policy_loss(LOGP, OLD, ADV, MASK * keep, COUNTS, settings("dapo")).loss  # kept tokens / 5
    k3 = torch.exp(ref - LOGP) - (ref - LOGP) - 1
    assert float(loss) == pytest.approx(float(policy) + 0.5 * float((k3 * MASK).sum()) / 5, abs=1e-6)
    # grpo: each sequence still divides by all its real tokens
    g = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("grpo"), policy_mask=keep).loss
    # row 0 keeps r=1.5 (clipped to 1.28) and r=0.5 (A>0); row 1 keeps r=0.5 (A<0: clipped to 0.8)
    assert float(g) == pytest.approx((-(1.28 + 0.5) / 3 + 0.8 / 2) / 2, abs=1e-6)


def test_kl_estimators_by_hand():
    x = torch.tensor([0.5, -0.2])  # logp - ref
    assert torch.allclose(kl_k1(x, torch.zeros(2)), x)
    assert torch.allclose(kl_k2(x, torch.zeros(2)), 0.5 * x**2)
    out = policy_loss(
        LOGP, OLD, ADV, MASK, COUNTS, settings("bnpo", beta=0.5, kl_estimator="k2"), torch.zeros_like(LOGP)
    )
    k2 = 0.5 * LOGP**2
    assert float(out.kl_tokens) == pytest.approx(float((k2 * MASK).sum()), rel=1e-6)
    assert float(out.loss) == pytest.approx((-0.48 + 0.5 * float((k2 * MASK).sum())) / 5, abs=1e-6)
    # the sequence KL used as a reward penalty sums k1 over each completion's real tokens
    assert torch.allclose(sequence_kl(LOGP, OLD, MASK), torch.tensor([math.log(0.75), math.log(0.75)]), atol=1e-6)


def test_entropy_mask_keeps_the_top_quantile():
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])  # 5.0 is padding: ignored
    # real entropies sorted 0.1 0.3 0.5 0.7 0.9; the 60% quantile (linear) = 0.5 + 0.4 * 0.2 = 0.58
    kept = high_entropy_mask(entropy, MASK, quantile=0.4)
    assert kept.tolist() == [[0, 0, 1], [0, 1, 0]]
    assert torch.equal(high_entropy_mask(entropy, MASK, 1.0), MASK)


def test_entropy_bonus_lowers_the_loss():
    entropy = torch.full_like(LOGP, 2.0)
    base = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("bnpo")).loss
    bonus = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("bnpo", entropy_coeff=0.1), entropy=entropy).loss
    assert float(bonus) == pytest.approx(float(base) - 0.1 * 2.0, abs=1e-6)


def test_engine_mismatch_weights_truncate():
    trainer = torch.tensor([[0.0, 0.0, -1.0]])
    engine = torch.tensor([[-1.0, 0.0, 0.0]])
    w = engine_mismatch_weights(trainer, engine, torch.ones(1, 3), "token_truncate", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, math.exp(-1)]]))  # e^1 = 2.72 capped at 2
    loss = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("bnpo"), token_weights=torch.full_like(LOGP, 0.5)).loss
    assert float(loss) == pytest.approx(0.5 * -0.48 / 5, abs=1e-6)


# two completions of 3 tokens, the second's last token is padding; log(pi_trainer) - log(pi_engine) per token
GAP = torch.tensor([[math.log(4.0), 0.0, math.log(0.25)], [math.log(0.5), math.log(0.5), 7.0]])
GAP_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "mode, cap, floor, expected",
    [
        # per token: ratios 4, 1, 1/4 | 1/2, 1/2, (padding: e^0 = 1)
        ("token_truncate", 3.0, None, [[3.0, 1.0, 0.25], [0.5, 0.5, 1.0]]),
        ("token_truncate", 3.0, 0.4, [[3.0, 1.0, 0.4], [0.5, 0.5, 1.0]]),
        ("token_mask", 3.0, None, [[0.0, 1.0, 0.25], [0.5, 0.5, 1.0]]),
        # IcePop's two-sided mask: both bounds
        ("token_mask", 3.0, 0.4, [[0.0, 1.0, 0.0], [0.5, 0.5, 1.0]]),
        ("token_mask", None, 0.4, [[4.0, 1.0, 0.0], [0.5, 0.5, 1.0]]),
        # per completion: 4 * 1 * 1/4 = 1 | 1/2 * 1/2 = 1/4 (the padding's 7 is left out)
        ("sequence_truncate", 3.0, None, [[1.0], [0.25]]),
        ("sequence_truncate", 3.0, 0.5, [[1.0], [0.5]]),
        ("sequence_mask", 3.0, None, [[1.0], [0.25]]),
        ("sequence_mask", 3.0, 0.5, [[1.0], [0.0]]),
        ("sequence_mask", 0.9, None, [[0.0], [0.25]]),
    ],
)
def test_engine_mismatch_weights_by_hand(mode, cap, floor, expected):
    w = engine_mismatch_weights(GAP, torch.zeros_like(GAP), GAP_MASK, mode, cap, floor)
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)


def test_engine_mismatch_weights_leave_an_unscored_token_alone_and_carry_no_gradient():
    trainer = torch.tensor([[math.log(2.0), math.log(8.0)]], requires_grad=True)
    engine = torch.tensor([[float("nan"), 0.0]])
    w = engine_mismatch_weights(trainer, engine, torch.ones(1, 2), "sequence_truncate", cap=None, floor=None)
    assert torch.allclose(w, torch.tensor([[8.0]])) and not w.requires_grad  # the NaN token counts as no gap
    with pytest.raises(ValueError, match="token_truncate"):
        engine_mismatch_weights(trainer, engine, torch.ones(1, 2), "sequence")


def test_a_sequence_weight_scales_every_token_of_its_completion_in_the_loss():
    def loss(weight: float) -> torch.Tensor:
        weights = torch.full((LOGP.shape[0], 1), weight)
        return policy_loss(LOGP, OLD, ADV, MASK, COUNTS, settings("bnpo"), token_weights=weights).loss

    loss_1, half = loss(1.0), loss(0.5)
    assert float(half) == pytest.approx(0.5 * float(loss_1), abs=1e-7)


def test_none_rewards_are_left_out_of_the_statistics():
    r = torch.tensor([[1.0, float("nan"), 0.0, 1.0]])
    # mean of [1, 0, 1] = 2/3; unbiased std = sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    a = group_advantages(r, "group")
    s = math.sqrt(1 / 3) + EPS
    assert torch.allclose(a, torch.tensor([[1 / 3 / s, 0.0, -2 / 3 / s, 1 / 3 / s]]), atol=1e-6)


@pytest.mark.parametrize("mode", ["sum_then_normalize", "normalize_then_sum"])
def test_a_completion_no_reward_scored_gets_advantage_0_and_stays_out_of_the_statistics(mode):
    nan = float("nan")
    # completion 1: every reward returned None; completion 2: only the second did
    per_reward = torch.tensor([[[1.0, nan, 0.0, 1.0, 0.0]], [[0.5, nan, nan, 0.0, 1.0]]])
    w = torch.tensor([1.0, 2.0])
    a = combine_rewards(per_reward, w, mode)
    assert a[0, 1] == 0.0
    # the same advantages as if the unscored completion had never been generated
    without = combine_rewards(per_reward[:, :, [0, 2, 3, 4]], w, mode)
    assert torch.allclose(a[0, [0, 2, 3, 4]], without[0], atol=1e-6)
    if mode == "sum_then_normalize":  # a partly scored one counts its None as 0 (TRL's nansum)
        assert torch.allclose(without, group_advantages(torch.tensor([[2.0, 0.0, 1.0, 2.0]])))


def test_reward_combination_modes():
    per_reward = torch.tensor([[[1.0, 0.0, 0.0, 1.0]], [[10.0, 20.0, 30.0, 40.0]]])
    w = torch.tensor([1.0, 1.0])
    # sum then normalize: the large reward dominates: [11, 20, 30, 41] is monotonic
    a = combine_rewards(per_reward, w, "sum_then_normalize")
    assert torch.allclose(a, group_advantages(torch.tensor([[11.0, 20.0, 30.0, 41.0]])))
    assert a[0].argsort().tolist() == [0, 1, 2, 3]
    # normalize then sum (GDPO): each reward counts equally. norm(r1) = +-0.866,
    # norm(r2) = [-15, -5, 5, 15] / 12.91 = [-1.162, -0.387, 0.387, 1.162]
    n1 = 0.5 / (math.sqrt(1 / 3) + EPS)
    n2 = torch.tensor([-15.0, -5.0, 5.0, 15.0]) / (math.sqrt(500 / 3) + EPS)
    summed = torch.tensor([n1, -n1, -n1, n1]) + n2
    b = combine_rewards(per_reward, w, "normalize_then_sum")
    assert torch.allclose(b[0], summed / (summed.std() + EPS), atol=1e-5)
    # summed = [-0.296, -1.253, -0.479, 2.028]: the 0/1 reward now outranks a +10 difference
    assert b[0].argsort().tolist() == [1, 2, 0, 3]


def test_mix_reference():
    policy, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    expected = [0.6 * p.detach() + 0.4 * r.detach() for p, r in zip(policy.parameters(), ref.parameters())]
    mix_reference(ref, policy, 0.6)
    for e, r in zip(expected, ref.parameters()):
        assert torch.allclose(e, r)
