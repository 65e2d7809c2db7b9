"""The clipped GRPO objective and the table of loss aggregations.

Per token t of completion i (PPO's clipped surrogate, Schulman et al. 2017, as used by GRPO):

    r_it   = exp(logp_it - old_logp_it)
    loss_it = -min(r_it * A_i, clip(r_it, 1 - eps, 1 + eps_high) * A_i) + beta * KL_it

How the per-token losses are averaged is a named entry in `AGGREGATIONS`; each divides by
counts of the *whole optimizer step* (`StepCounts`), so summing the micro-batch losses gives
exactly the loss of the full batch, however it is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from plait.algo.kl import kl_k3


@dataclass(frozen=True)
class StepCounts:
    """Sizes of the whole optimizer step (all micro-batches, all processes)."""

    sequences: int
    tokens: int
    micro_batches: int
    max_completion_length: int


def _grpo(loss, mask, n: StepCounts):
    """Mean over each sequence's tokens, then mean over sequences (DeepSeekMath GRPO)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / n.sequences


def _bnpo(loss, mask, n: StepCounts):
    """Token mean within each micro-batch, then mean over micro-batches (TRL's 'bnpo')."""
    return (loss * mask).sum() / mask.sum().clamp(min=1) / n.micro_batches


def _dapo(loss, mask, n: StepCounts):
    """Token mean over the whole step (DAPO, Yu et al. 2025, arXiv:2503.14476): every token
    weighs the same, so long completions are not down-weighted."""
    return (loss * mask).sum() / max(n.tokens, 1)


def _dr_grpo(loss, mask, n: StepCounts):
    """Sum over tokens divided by a constant, sequences x max_completion_length
    (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783): removes the length bias."""
    return (loss * mask).sum() / (n.sequences * n.max_completion_length)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, StepCounts], torch.Tensor]] = {
    "grpo": _grpo,
    "bnpo": _bnpo,
    "dapo": _dapo,
    "dr_grpo": _dr_grpo,
}


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token -min(r A, clip(r, 1-eps, 1+eps_high) A), and where each clip side was active.

    advantages: [B] (broadcast over tokens). A side counts as active where the clipped term
    is the one min() picked and differs from the unclipped one (its gradient is zero there).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * adv
    loss = -torch.min(unclipped, clipped)
    low = (ratio < 1 - epsilon) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, low, high


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    counts: StepCounts,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss, and summed metrics (divide by counts.tokens).

    logp, old_logp, ref_logp, mask: [B, C]; advantages: [B].
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    per_token, low, high = clipped_surrogate(logp, old_logp, advantages, epsilon, eps_high)
    mask = mask.to(per_token.dtype)
    metrics = {
        "clip_low_tokens": (low * mask).sum().detach(),
        "clip_high_tokens": (high * mask).sum().detach(),
    }
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + beta * kl
        metrics["kl_tokens"] = (kl * mask).sum().detach()
    loss = AGGREGATIONS[loss_type](per_token, mask, counts)
    return loss, metrics
