"""KL between the policy and the reference model: per-token estimators, and reference sync.

With x = log pi(y) - log pi_ref(y) for a token sampled from pi (Schulman,
http://joschu.net/blog/kl-approx.html):

    k1 = x                      unbiased, high variance, can be negative
    k2 = x^2 / 2                biased, low variance, >= 0
    k3 = exp(-x) - 1 + x        unbiased, low variance, >= 0 (GRPO, DeepSeekMath eq. 4)
"""

from __future__ import annotations

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-completion KL, summed over its tokens: [B]. Used as a reward penalty."""
    return (KL_ESTIMATORS[estimator](logp, ref_logp) * mask).sum(-1)


@torch.no_grad()
def mix_reference(ref_model, model, alpha: float) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, in place (TR-DPO style reference sync,
    Gorbatovski et al. 2024, arXiv:2404.09656; alpha = 1 copies the policy)."""
    for r, p in zip(ref_model.parameters(), model.parameters()):
        r.mul_(1 - alpha).add_(p.detach().to(r.dtype), alpha=alpha)
