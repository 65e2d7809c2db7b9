"""Per-token KL estimators between the policy and a frozen reference model."""

from __future__ import annotations

import torch


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref), per token (http://joschu.net/blog/kl-approx.html):

        k3 = exp(ref - logp) - (ref - logp) - 1      (>= 0, unbiased, low variance)

    as used by GRPO (DeepSeekMath, eq. 4).
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1
