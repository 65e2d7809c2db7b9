"""Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300)."""

from __future__ import annotations

import torch

EPS = 1e-4


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = EPS) -> torch.Tensor:
    """Advantages for rewards shaped [groups, num_generations].

        A_ij = (r_ij - mean_j r_ij) / (s + eps)

    with s = the std of group i (`scale="group"`, GRPO), the std of the whole batch
    (`"batch"`, more robust with small groups; Liu et al. 2025 "Dr. GRPO" argue against
    per-group scaling), or 1 (`"none"`). std is the unbiased (n-1) estimator, as in TRL.
    A group whose rewards are all equal gets zero advantage: it teaches nothing.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, num_generations], got shape {tuple(rewards.shape)}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if rewards.shape[1] < 2 and scale == "group":
        return centred
    std = rewards.std(dim=1, keepdim=True) if scale == "group" else rewards.std().expand(rewards.shape[0], 1)
    return centred / (std + eps)
