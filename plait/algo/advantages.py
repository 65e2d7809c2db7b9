"""Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300).

Rewards are [groups, num_generations]; NaN marks "not applicable" (a reward returned None)
and is left out of that group's statistics, getting advantage 0.
"""

from __future__ import annotations

import torch


EPS = 1e-4
SCALES = ("group", "batch", "none")  # what the centred rewards are divided by (group_advantages)
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # how several rewards combine (combine_rewards)


def _nanstd(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """Unbiased std ignoring NaN (0 where fewer than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    n = (~x.isnan()).sum(dim=dim, keepdim=True) if dim is not None else (~x.isnan()).sum()
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (n - 1).clamp(min=1)
    std = var.sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = EPS) -> torch.Tensor:
    """Advantages for rewards shaped [groups, num_generations].

        A_ij = (r_ij - mean_j r_ij) / (s + eps)

    with s = the std of group i (`scale="group"`, GRPO), the std of the whole batch
    (`"batch"`, more robust with small groups), or 1 (`"none"`, Dr. GRPO argues the std
    division biases towards too-easy and too-hard prompts). std is the unbiased (n-1)
    estimator, as in TRL. A group whose rewards are all equal gets zero advantage.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, num_generations], got shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (_nanstd(rewards, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (_nanstd(rewards) + eps)
    return torch.nan_to_num(centred, nan=0.0)


def combine_rewards(
    per_reward: torch.Tensor, weights: torch.Tensor, mode: str = "sum_then_normalize", scale: str = "group"
) -> torch.Tensor:
    """Advantages from several rewards, per_reward [R, groups, n], weights [R].

    sum_then_normalize (GRPO): A = norm(sum_k w_k r_k); a None counts as 0 in the sum (as in
    TRL), and a completion every reward left unscored (all None) stays out of its group's
    statistics and gets advantage 0.
    normalize_then_sum (GDPO, group reward-decoupled normalization): A = sum_k w_k norm(r_k),
    then divided by its batch std, so a reward with a large range cannot drown the others; a
    None drops out of its own reward's statistics, and an all-None completion gets advantage 0
    and stays out of the batch std too.
    """
    unscored = per_reward.isnan().all(0)  # [groups, n]
    if mode == "sum_then_normalize":
        total = (torch.nan_to_num(per_reward, nan=0.0) * weights[:, None, None]).sum(0)
        return group_advantages(total.masked_fill(unscored, float("nan")), scale)
    if mode not in AGGREGATIONS:
        raise ValueError(f"mode must be one of {AGGREGATIONS}, got {mode!r}")
    summed = sum(w * group_advantages(r, scale) for w, r in zip(weights, per_reward))
    scored = summed[~unscored]
    return summed / (scored.std() + EPS) if scored.numel() > 1 else summed
