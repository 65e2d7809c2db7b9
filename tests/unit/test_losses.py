"""Every loss aggregation against numbers worked out by hand in the comments."""

import math

import pytest
import torch

from plait.algo.kl import kl_k3
from plait.algo.losses import LOSS_TYPES, LossSettings, StepCounts, clipped_objective, policy_loss


# two completions, three positions; the last token of row 1 is padding.
# ratios r = exp(logp - old): row 0 (A=+1): 1.0, 1.5, 0.5; row 1 (A=-1): 0.5, 1.5, 1.0
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
LOGP = OLD + RATIOS.log()
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
EPS, EPS_HIGH = 0.2, 0.28
# per-token loss -min(rA, clip(r, 0.8, 1.28)A):
#   row 0: -min(1, 1) = -1 ; -min(1.5, 1.28) = -1.28 (high clip) ; -min(.5, .8) = -0.5
#   row 1:  max(.5, .8) = 0.8 (low clip) ; max(1.5, 1.28) = 1.5 ; max(1, 1) = 1 (masked)
PER_TOKEN = torch.tensor([[-1.0, -1.28, -0.5], [0.8, 1.5, 1.0]])
COUNTS = StepCounts(sequences=2, tokens=5, micro_batches=1, max_completion_length=4)


def S(loss_type="dapo", **kw):
    return LossSettings(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, **kw)


def test_clipped_surrogate_both_sides():
    loss, low, high, capped = clipped_objective(LOGP, LOGP - OLD, ADV, LossSettings(epsilon=EPS, epsilon_high=EPS_HIGH))
    assert not capped.any()  # no delta, nothing capped
    assert torch.allclose(loss, PER_TOKEN, atol=1e-6)
    assert low.tolist() == [[False, False, False], [True, False, False]]
    assert high.tolist() == [[False, True, False], [False, False, False]]


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((-1 - 1.28 - 0.5) / 3 + (0.8 + 1.5) / 2) / 2),  # mean per row, mean of rows
        ("bnpo", (-1 - 1.28 - 0.5 + 0.8 + 1.5) / 5),  # token mean over the micro-batch
        ("dapo", (-1 - 1.28 - 0.5 + 0.8 + 1.5) / 5),  # token mean over the step (= batch here)
        ("dr_grpo", (-1 - 1.28 - 0.5 + 0.8 + 1.5) / (2 * 4)),  # sum / (sequences x max_len)
    ],
)
def test_aggregations_by_hand(loss_type, expected):
    out = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, S(loss_type))
    assert float(out.loss) == pytest.approx(expected, abs=1e-6)
    assert float(out.clip_low_tokens) == 1 and float(out.clip_high_tokens) == 1


def test_dapo_divides_by_the_whole_step_tokens():
    counts = StepCounts(sequences=4, tokens=10, micro_batches=2, max_completion_length=4)
    loss = policy_loss(LOGP, OLD, ADV, MASK, counts, S("dapo")).loss
    assert float(loss) == pytest.approx(-0.48 / 10, abs=1e-6)


def test_epsilon_high_defaults_to_epsilon():
    loss = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, LossSettings("bnpo", 0.2, None)).loss
    # the high-clipped token now clips at 1.2 instead of 1.28
    assert float(loss) == pytest.approx((-1 - 1.2 - 0.5 + 0.8 + 1.5) / 5, abs=1e-6)


def test_kl_k3_by_hand_and_in_the_loss():
    ref = torch.zeros_like(LOGP)
    k3 = kl_k3(LOGP, ref)
    d = -LOGP  # ref - logp
    assert torch.allclose(k3, d.exp() - d - 1)
    assert (k3 >= 0).all()
    assert float(kl_k3(LOGP, LOGP).abs().max()) == 0.0
    beta = 0.1
    out = policy_loss(LOGP, OLD, ADV, MASK, COUNTS, S("bnpo", beta=beta), ref)
    masked_kl = float((k3 * MASK).sum())
    assert float(out.kl_tokens) == pytest.approx(masked_kl, rel=1e-6)
    assert float(out.loss) == pytest.approx((-0.48 + beta * masked_kl) / 5, abs=1e-6)


def test_beta_without_reference_is_an_error():
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(LOGP, OLD, ADV, MASK, COUNTS, S("grpo", beta=0.1))


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_micro_batch_losses_add_up_to_the_full_batch(loss_type):
    """Each aggregation divides by whole-step counts, so accumulated micro-batch losses and
    gradients equal the full batch's (bnpo's micro-batch mean is its definition)."""
    torch.manual_seed(0)
    logp = torch.randn(4, 5, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    tokens = int(mask.sum())
    if loss_type == "bnpo":
        # bnpo equals the full-batch token mean only when micro-batches hold equal token counts (6, 6)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
        tokens = int(mask.sum())
    full = policy_loss(logp, old, adv, mask, StepCounts(4, tokens, 1, 5), S(loss_type)).loss
    (g_full,) = torch.autograd.grad(full, logp)
    counts = StepCounts(4, tokens, 2, 5)
    parts = [
        policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], counts, S(loss_type)).loss
        for i in (0, 2)
    ]
    (g_split,) = torch.autograd.grad(sum(parts), logp)
    assert float(sum(parts).detach()) == pytest.approx(float(full.detach()), abs=1e-6)
    assert torch.allclose(g_full, g_split, atol=1e-7)


def test_first_pass_ratio_is_one_and_gradient_is_advantage_weighted():
    """With old = logp.detach() (num_iterations=1) the ratio is exactly 1 and the gradient of
    the bnpo loss w.r.t. logp is -A / tokens on every real token."""
    logp = torch.randn(2, 3, requires_grad=True)
    out = policy_loss(logp, logp.detach(), ADV, MASK, COUNTS, S("bnpo"))
    loss = out.loss
    (g,) = torch.autograd.grad(loss, logp)
    assert float(out.clip_low_tokens + out.clip_high_tokens) == 0
    assert torch.allclose(g, -ADV[:, None] * MASK / 5)
    assert math.isclose(float(loss.detach()), float(-(ADV[:, None] * MASK).sum() / 5), abs_tol=1e-7)
