"""Advantage estimators: how a completion's reward becomes the weight of its tokens' gradient.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) centres each reward on its group's
mean; the others in ESTIMATORS change the baseline or the normalization. Rewards are
[groups, num_generations]; NaN marks "not applicable" (a reward returned None, or every reward
did) and is left out of that group's statistics, getting advantage 0.
"""

from __future__ import annotations

from typing import Callable

import torch

from plait.algo.names import REWARD_AGGREGATIONS, SCALES


EPS = 1e-4


def _nanstd(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """Unbiased std ignoring NaN (0 where fewer than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    n = (~x.isnan()).sum(dim=dim, keepdim=True) if dim is not None else (~x.isnan()).sum()
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (n - 1).clamp(min=1)
    std = var.sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


def _flat(rewards: torch.Tensor) -> torch.Tensor:
    """[groups, 1]: True where a group's scored rewards are all equal. Its float mean can be an
    ulp off the common value (eight rewards of 1.7 in float32), so centring alone would give
    every completion the same tiny advantage instead of the 0 that leaves the group out."""
    scored = ~rewards.isnan()
    high = rewards.masked_fill(~scored, float("-inf")).amax(1, keepdim=True)
    low = rewards.masked_fill(~scored, float("inf")).amin(1, keepdim=True)
    return high == low


def _centred(rewards: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """rewards - baseline, exactly 0 in a group of equal rewards (_flat); NaN stays NaN."""
    return (rewards - baseline).masked_fill(_flat(rewards) & ~rewards.isnan(), 0.0)


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
    centred = _centred(rewards, torch.nanmean(rewards, dim=1, keepdim=True))
    if scale == "group":
        centred = centred / (_nanstd(rewards, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (_nanstd(rewards) + eps)
    return torch.nan_to_num(centred, nan=0.0)


def weighted_total(per_reward: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w_k r_k of per_reward [R, groups, n]: a None counts as 0 (as in TRL), and a
    completion every reward left unscored is NaN."""
    unscored = per_reward.isnan().all(0)
    total = (torch.nan_to_num(per_reward, nan=0.0) * weights[:, None, None]).sum(0)
    return total.masked_fill(unscored, float("nan"))


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
    if mode == "sum_then_normalize":
        return group_advantages(weighted_total(per_reward, weights), scale)
    if mode not in REWARD_AGGREGATIONS:
        raise ValueError(f"mode must be one of {REWARD_AGGREGATIONS}, got {mode!r}")
    unscored = per_reward.isnan().all(0)  # [groups, n]
    summed = sum(w * group_advantages(r, scale) for w, r in zip(weights, per_reward))
    scored = summed[~unscored]
    return summed / (scored.std() + EPS) if scored.numel() > 1 else summed


# ---------------------------------------------------------------- other estimators
#
# Each takes rewards [groups, n] (NaN = unscored) and the completions' token counts [groups, n]
# and returns the same shape, NaN kept where the reward was NaN; `scale` is group / batch / none.


def _scaled(centred: torch.Tensor, rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """centred / group std of the rewards, or whitened over the batch (the advantages' own mean
    and std, as TRL's RLOO normalize_advantages), or as is."""
    if scale == "group":
        return centred / (_nanstd(rewards, dim=1, keepdim=True) + EPS)
    if scale == "batch":
        return (centred - torch.nanmean(centred)) / (_nanstd(centred) + EPS)
    if scale != "none":
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return centred


def grpo_advantages(rewards: torch.Tensor, lengths: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """GRPO: r - mean of the group (group_advantages, whose "batch" divides by the rewards' std)."""
    scored = group_advantages(rewards, scale)
    return scored.masked_fill(rewards.isnan(), float("nan"))


def rloo_advantages(rewards: torch.Tensor, lengths: torch.Tensor, scale: str = "none") -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): each completion's baseline is the mean of
    the *other* scored completions of its group,

        A_i = r_i - (sum_j r_j - r_i) / (m - 1)  =  m / (m - 1) (r_i - mean r),   m scored,

    so the baseline never contains the completion it judges. A group with fewer than two scored
    completions has no baseline: NaN (advantage 0, left out of the batch statistics). Same as
    TRL's RLOOTrainer (scale "batch" is its normalize_advantages=True)."""
    scored = ~rewards.isnan()
    m = scored.sum(1, keepdim=True).to(rewards.dtype)
    others = (torch.nansum(rewards, 1, keepdim=True) - rewards) / (m - 1)
    centred = torch.where(m > 1, _centred(rewards, others), float("nan"))  # NaN: out of any batch statistics
    return _scaled(centred, rewards, scale)


def opo_advantages(rewards: torch.Tensor, lengths: torch.Tensor, scale: str = "none") -> torch.Tensor:
    """OPO, on-policy RL with the optimal baseline (Hao et al. 2025, arXiv:2505.23585): the
    baseline is the group's length-weighted mean reward, b = sum_j l_j r_j / sum_j l_j, the
    variance-minimizing baseline when the loss sums over tokens (pair with loss_type dr_grpo).
    A group whose scored completions have no tokens falls back to the plain mean."""
    scored = ~rewards.isnan()
    w = torch.where(scored, lengths.to(rewards.dtype), torch.zeros_like(rewards))
    weighted = torch.nansum(rewards * w, 1, keepdim=True) / w.sum(1, keepdim=True)
    baseline = torch.where(w.sum(1, keepdim=True) > 0, weighted, torch.nanmean(rewards, 1, keepdim=True))
    return _scaled(_centred(rewards, baseline), rewards, scale)


def reinforce_pp_scores(rewards: torch.Tensor, lengths: torch.Tensor, scale: str = "batch") -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): no group baseline; the scores become
    token returns (reinforce_pp_returns) that are whitened over the whole round's tokens."""
    return rewards.clone()


def reinforce_pp_baseline_scores(rewards: torch.Tensor, lengths: torch.Tensor, scale: str = "batch") -> torch.Tensor:
    """REINFORCE++-baseline: the group mean is subtracted first (no std division: OpenRLHF's
    reinforce_baseline, veRL's reinforce_plus_plus_baseline), then whitened like REINFORCE++."""
    return _centred(rewards, torch.nanmean(rewards, 1, keepdim=True))


Estimator = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "opo": opo_advantages,
    "reinforce_pp": reinforce_pp_scores,
    "reinforce_pp_baseline": reinforce_pp_baseline_scores,
}


def reinforce_pp_returns(scores: torch.Tensor, mask: torch.Tensor, token_kl: torch.Tensor | None, beta: float):
    """Token returns with gamma = 1, [B, C]: the score is the reward of the last token and
    -beta x KL_t the reward of every token (the KL-in-reward form REINFORCE++ is used with), so

        G_t = score - beta * sum_{s >= t} KL_s.

    Without a KL penalty every token of a completion carries its score."""
    returns = scores[:, None].expand_as(mask).to(torch.float32)
    if token_kl is not None:
        future_kl = (token_kl * mask).flip(-1).cumsum(-1).flip(-1)
        returns = returns - beta * future_kl
    return returns * mask


def whiten(values: torch.Tensor, sums: tuple[float, float, float], scale: str) -> torch.Tensor:
    """(G - mean) / std with the round's token statistics, as OpenRLHF normalizes REINFORCE++
    (biased variance floored at 1e-8; veRL's masked_whiten uses the unbiased one, a relative
    difference of 1 / (2 x tokens)). `sums` = (tokens, sum G, sum G^2) over every process's
    loss tokens; scale "none" only centres (OpenRLHF's no_advantage_std_norm)."""
    count, total, squares = sums
    if count == 0:
        return torch.zeros_like(values)
    mean = total / count
    out = values - mean
    if scale == "batch":
        out = out / max(squares / count - mean * mean, 1e-8) ** 0.5
    elif scale != "none":
        raise ValueError(f"REINFORCE++ whitens over the batch's tokens: scale must be batch or none, got {scale!r}")
    return out


def teacher_advantages(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, weight: float = 1.0
) -> torch.Tensor:
    """On-policy distillation's per-token advantage, [B, C] without gradient:

        A_t = weight x (log pi_teacher(y_t) - log pi_student(y_t)),   0 off the loss tokens

    the negated one-sample estimate of the reverse KL KL(pi_student || pi_teacher) at each token
    the student sampled (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines' "On-policy
    distillation", 2025). A token the teacher finds likelier than the student is pushed up, one it
    finds unlikely is pushed down; no group is needed."""
    return (weight * (teacher_logp - student_logp) * mask).detach()


def with_teacher(
    advantages: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, weight: float
) -> torch.Tensor:
    """The rewards' advantages ([B] per completion, or [B, C] per token) plus the teacher's, per token: [B, C]."""
    per_token = advantages[:, None] if advantages.dim() == 1 else advantages
    return per_token + teacher_advantages(student_logp, teacher_logp, mask, weight)
