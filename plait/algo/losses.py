"""Policy objectives and loss aggregations, each a named table entry.

A `loss_type` is an (objective, aggregation) pair from `LOSS_TYPES`:

    grpo    clipped  + mean per sequence, then over sequences   (DeepSeekMath, arXiv:2402.03300)
    bnpo    clipped  + token mean per micro-batch               (TRL's "bnpo")
    dapo    clipped  + token mean over the whole step           (DAPO, arXiv:2503.14476)
    dr_grpo clipped  + token sum / (sequences x max length)     (Dr. GRPO, arXiv:2503.20783)
    cispo   cispo    + token mean over the whole step           (MiniMax-M1, arXiv:2506.13585)

Aggregations divide by counts of the *whole optimizer step* (`StepCounts`), so summing the
micro-batch losses gives exactly the loss of the full batch, however it is split. `policy_loss`
returns `LossOutputs`: the loss and its statistics, each field with the rule that logs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from plait.algo.kl import KL_ESTIMATORS
from plait.algo.names import ENGINE_IS_MODES, IS_LEVELS, LOSS_TYPES
from plait.algo.stats import stat


@dataclass(frozen=True)
class StepCounts:
    """Sizes of the whole optimizer step (all micro-batches, all processes)."""

    sequences: int
    tokens: int
    micro_batches: int
    max_completion_length: int


@dataclass(frozen=True)
class LossSettings:
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0  # KL in the loss; 0 when the KL goes into the reward instead
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False
    entropy_coeff: float = 0.0
    cispo_cap: float | None = None

    @classmethod
    def from_algo(cls, algo) -> "LossSettings":
        """The settings of a config's `algo` section (any object with its attributes)."""
        return cls(
            loss_type=algo.loss_type,
            epsilon=algo.epsilon,
            epsilon_high=algo.epsilon_high,
            delta=algo.delta,
            importance_sampling_level=algo.importance_sampling_level,
            beta=0.0 if algo.kl_in_reward else algo.beta,
            kl_estimator=algo.kl_estimator,
            kl_bias_correction=algo.kl_bias_correction,
            entropy_coeff=algo.entropy_coeff,
            cispo_cap=algo.cispo_cap,
        )

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weight_cap(self) -> float:
        """CISPO's cap on the importance weight: cispo_cap, else 1 + eps_high (MiniMax-M1)."""
        return 1 + self.eps_high if self.cispo_cap is None else self.cispo_cap


# ---------------------------------------------------------------- aggregations


def _grpo(loss, mask, n: StepCounts):
    """Mean over each sequence's tokens, then mean over sequences (DeepSeekMath GRPO)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / n.sequences


def _bnpo(loss, mask, n: StepCounts):
    """Token mean within each micro-batch, then mean over micro-batches (TRL's 'bnpo')."""
    return (loss * mask).sum() / mask.sum().clamp(min=1) / n.micro_batches


def _token_mean(loss, mask, n: StepCounts):
    """Token mean over the whole step (DAPO): every token weighs the same, so long
    completions are not down-weighted."""
    return (loss * mask).sum() / max(n.tokens, 1)


def _dr_grpo(loss, mask, n: StepCounts):
    """Sum over tokens divided by a constant, sequences x max_completion_length
    (Dr. GRPO): removes the length bias."""
    return (loss * mask).sum() / (n.sequences * n.max_completion_length)


Aggregation = Callable[[torch.Tensor, torch.Tensor, StepCounts], torch.Tensor]
AGGREGATIONS: dict[str, Aggregation] = {"grpo": _grpo, "bnpo": _bnpo, "dapo": _token_mean, "dr_grpo": _dr_grpo}


# ---------------------------------------------------------------- importance ratios


def importance_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi / pi_old) per token ("token", GRPO), or the length-normalised sequence ratio
    log s_i = mean_t log(pi / pi_old) broadcast to every token ("sequence", GSPO, Zheng et al.
    2025, arXiv:2507.18071), which clips whole sequences instead of single tokens."""
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}")
    seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return seq.expand_as(log_ratio)


# ---------------------------------------------------------------- objectives


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """[B] advantages (one per completion) broadcast over the tokens; [B, C] ones as they are."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def clipped_objective(logp, log_ratio, advantages, s: LossSettings):
    """PPO's clipped surrogate (Schulman et al. 2017) as GRPO uses it, per token:

        loss = -min(r A, clip(r, 1 - eps, 1 + eps_high) A)

    eps_high > eps is DAPO's clip-higher. With `delta` (INTELLECT-2 two-sided clipping,
    arXiv:2505.07291) the unclipped term's ratio is also capped at delta, bounding the update
    on negative-advantage tokens whose ratio has grown large.
    Returns (loss, low-clip mask, high-clip mask, delta-capped mask).
    """
    ratio = torch.exp(log_ratio)
    adv = per_token(advantages)
    unclipped_ratio = ratio if s.delta is None else torch.clamp(ratio, max=s.delta)
    clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.eps_high) * adv
    loss = -torch.min(unclipped_ratio * adv, clipped)
    low = (ratio < 1 - s.epsilon) & (adv < 0)
    high = (ratio > 1 + s.eps_high) & (adv > 0)
    capped = (ratio > s.delta) & (adv < 0) if s.delta is not None else torch.zeros_like(low)
    return loss, low, high, capped


def cispo_objective(logp, log_ratio, advantages, s: LossSettings):
    """CISPO (MiniMax-M1): clip the importance weight itself and stop its gradient, so every
    token keeps a gradient (none is dropped by clipping):

        loss = -sg(min(r, cap)) * A * log pi,   cap = 1 + eps_high unless cispo_cap is set
    """
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=s.weight_cap).detach()
    loss = -weight * per_token(advantages) * logp
    high = ratio > s.weight_cap
    none = torch.zeros_like(high)
    return loss, none, high, none


OBJECTIVES = {"clipped": clipped_objective, "cispo": cispo_objective}


# token means are over the loss tokens that went through the model, all processes (the trainer
# counts them: plait.train.update)
_TOKENS = "measured_tokens"


@dataclass(kw_only=True)
class LossOutputs:
    """A micro-batch's share of the step loss (with its gradient) and its statistics, sums
    over its loss tokens (no gradient); each field's rule says how it is logged (plait.algo.stats)."""

    loss: torch.Tensor = stat("loss", per="updates")  # the mean over the round's updates
    clip_low_tokens: torch.Tensor = stat("clip/low", per=_TOKENS)
    clip_high_tokens: torch.Tensor = stat("clip/high", per=_TOKENS)
    ratio_tokens: torch.Tensor = stat("ratio/mean", per=_TOKENS)
    # negative-advantage tokens whose ratio the two-sided clip capped (None: no delta)
    delta_capped_tokens: torch.Tensor | None = stat("clip/delta", per=_TOKENS, optional=True)
    kl_tokens: torch.Tensor | None = stat("kl", per=_TOKENS, optional=True)  # None: beta = 0
    DERIVED: ClassVar[dict[str, tuple[str, ...]]] = {"clip/fraction": ("clip/low", "clip/high")}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    counts: StepCounts,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    policy_mask: torch.Tensor | None = None,
) -> LossOutputs:
    """This micro-batch's share of the step loss, and its statistics (per token sums).

    logp, old_logp, ref_logp, entropy, token_weights, mask, policy_mask: [B, C]; advantages: [B]
    (one per completion) or [B, C].
    token_weights multiply the per-token policy term (the engine-mismatch correction);
    policy_mask keeps the policy term of some tokens only (high_entropy_mask), while the KL
    term and the normalizers still see every token of `mask`, as in arXiv:2506.01939.
    """
    objective, aggregation = LOSS_TYPES[settings.loss_type]
    log_ratio = importance_log_ratio(logp, old_logp, mask, settings.importance_sampling_level)
    per_token, low, high, capped = OBJECTIVES[objective](logp, log_ratio, advantages, settings)
    if token_weights is not None:
        per_token = per_token * token_weights
    if policy_mask is not None:
        per_token = per_token * policy_mask.to(per_token.dtype)
    mask = mask.to(per_token.dtype)
    kl_tokens = None
    if settings.beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = KL_ESTIMATORS[settings.kl_estimator](logp, ref_logp)
        if settings.kl_bias_correction:  # the KL of pi, not pi_old's: weighted by the ratio, with its gradient
            kl = kl * torch.exp(log_ratio)
        per_token = per_token + settings.beta * kl
        kl_tokens = (kl * mask).sum().detach()
    if settings.entropy_coeff:
        if entropy is None:
            raise ValueError("entropy_coeff > 0 needs the per-token entropy")
        per_token = per_token - settings.entropy_coeff * entropy
    return LossOutputs(
        loss=AGGREGATIONS[aggregation](per_token, mask, counts),
        clip_low_tokens=(low * mask).sum().detach(),
        clip_high_tokens=(high * mask).sum().detach(),
        ratio_tokens=(torch.exp(log_ratio) * mask).sum().detach(),
        delta_capped_tokens=None if settings.delta is None else (capped * mask).sum().detach(),
        kl_tokens=kl_tokens,
    )


# ---------------------------------------------------------------- token selection and weights


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Keep only the top-`quantile` share of real tokens by entropy ("Beyond the 80/20 rule",
    Wang et al. 2025, arXiv:2506.01939: the high-entropy "forking" tokens carry the learning).
    quantile = 1 keeps every token. Ties at the threshold are kept."""
    if quantile >= 1.0:
        return mask
    real = entropy[mask.bool()]
    if real.numel() == 0:
        return mask
    threshold = torch.quantile(real.float(), 1.0 - quantile)
    return mask * (entropy >= threshold).to(mask.dtype)


def engine_log_ratio(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, per_sequence: bool = False
) -> torch.Tensor:
    """log(pi_trainer / pi_engine) of the sampled tokens, 0 on padding and where the engine could
    not score a token (NaN): [B, C], or summed over each completion's tokens, [B, 1]."""
    gap = torch.nan_to_num((trainer_logp - engine_logp) * mask, nan=0.0)
    return gap.sum(-1, keepdim=True) if per_sequence else gap


def engine_mismatch_weights(
    trainer_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    cap: float | None = 2.0,
    floor: float | None = None,
) -> torch.Tensor:
    """Importance weights for the gap between the engine that sampled and the trainer (Yao et
    al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"), no
    gradient, [B, C] for token modes and [B, 1] for sequence modes.

    The ratio is pi_trainer / pi_engine per token, or their product over the completion's real
    tokens (sequence modes). `*_truncate` clips it to [floor, cap]; `*_mask` sets it to 0 outside
    that range (token_mask with both bounds is IcePop's two-sided mask). A bound of None is no
    bound. A token the engine could not score (NaN) counts as no gap, as in TRL."""
    if mode not in ENGINE_IS_MODES:
        raise ValueError(f"unknown engine importance-sampling mode {mode!r}; one of {ENGINE_IS_MODES}")
    ratio = torch.exp(engine_log_ratio(trainer_logp, engine_logp, mask, mode.startswith("sequence"))).detach()
    if mode.endswith("truncate"):
        return ratio if cap is None and floor is None else torch.clamp(ratio, min=floor, max=cap)
    low = -math.inf if floor is None else floor
    high = math.inf if cap is None else cap
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


# ---------------------------------------------------------------- distillation


def top_k_distillation(student_top: torch.Tensor, teacher_top: torch.Tensor) -> torch.Tensor:
    """[B, C] per-position forward KL from the teacher's k likeliest tokens to the student:

        KL_t = sum_{v in K_t} q_t(v) (log q_t(v) - log pi_student(v)),   q_t = softmax over K_t of log pi_teacher

    student_top / teacher_top: [B, C, k] full-vocabulary log-probs of the same k tokens (the
    teacher's top k at each position). The teacher's top k, renormalized, stand for its whole
    distribution (the tail it leaves out is what top-k logit distillation drops; Agarwal et al.'s
    GKD with beta = 0 on the student's own samples, arXiv:2306.13649). Never negative: the
    student's mass on K is at most 1; 0 only when the student puts the teacher's renormalized
    probabilities on K and nothing elsewhere. Its gradient pulls the student's whole distribution
    at every position, not only the sampled token's log-prob."""
    return (torch.softmax(teacher_top, -1) * (torch.log_softmax(teacher_top, -1) - student_top)).sum(-1)
