"""The policy update of one round: log-prob prepass, advantages, and the clipped update.

    batch (collated groups) -> step_advantages  (algo.advantage_estimator, over every process's groups)
                            -> logprob_prepass  (old and reference log-probs, no gradients)
                            -> policy_update    (num_iterations x steps_per_generation updates)

(With the KL in the reward the advantages need the prepass's log-probs: prepass first.)

The arithmetic lives in plait.algo (pure tensor functions); this module feeds it micro-batches
and hands gradients to the backend. What the update measures is typed: the loss's `LossOutputs`
and the statistics classes below, each field with its rule; one `Sums` adds them up over the
round and turns them into its metrics (plait.algo.stats).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from plait import comm
from plait.algo.advantages import (
    ESTIMATORS,
    combine_rewards,
    reinforce_pp_returns,
    weighted_total,
    whiten,
    with_teacher,
)
from plait.algo.kl import KL_ESTIMATORS, sequence_kl
from plait.algo.logprobs import (
    can_pack,
    completion_logprobs,
    packed_group_logprobs,
    prompt_runs,
    shared_prompt_logprobs,
)
from plait.algo.losses import (
    LossOutputs,
    LossSettings,
    StepCounts,
    engine_log_ratio,
    engine_mismatch_weights,
    high_entropy_mask,
    policy_loss,
    top_k_distillation,
)
from plait.algo.names import DEFAULT_SCALE, TOKEN_WHITENED
from plait.algo.stats import Sums, stat
from plait.telemetry import PhaseTimer
from plait.train.backends.base import Backend, StepOutcome
from plait.train.batch import micro_batches
from plait.train.guard import NonFiniteGuard
from plait.train.hashes import RoundHashes
from plait.train.optim import scaled_lr
from plait.types import Batch, Group


def prompt_sharing(cfg, backend: Backend) -> str | None:
    """How a group's prompt goes through the model once for all its completions: "parts" (a
    plain model in one process: the group packed into one row through the decoder and output
    head apart, or a KV-cached prompt pass), "forward" (DDP, FSDP2, ZeRO: packed, through the
    wrapper's own forward, whose hooks pair one forward with one backward), or None
    (train.shared_prompt_pass off, or activation checkpointing, which recomputes without it)."""
    if not cfg.train.shared_prompt_pass or cfg.model.gradient_checkpointing:
        return None
    return "parts" if backend.shares_prompt_pass else "forward"


def sequence_logprobs(
    model,
    mb: Batch,
    temperature: float,
    with_entropy: bool | str = False,
    sharing: str | None = None,
    extra: torch.Tensor | None = None,
    top_k: int = 0,
):
    """[B, C] completion log-probs (and entropies) of a micro-batch; with `sharing`, each group
    is packed into one row without padding where the model allows (same numbers to float
    rounding, fewer FLOPs), else (a plain model only) its rows share one prompt pass. With
    `extra` [B, C, k] token ids the log-probs are [B, C, 1 + k]: the sampled token's, then theirs;
    with `top_k`, the model's k likeliest tokens at each position follow ([B, C, k] ids, log-probs)."""
    if sharing:
        runs = prompt_runs(mb.input_ids, mb.attention_mask, mb.prompt_len)
        if can_pack(getattr(model, "module", model)):  # one row per group, no padding at all
            return packed_group_logprobs(
                model,
                mb.input_ids,
                mb.attention_mask,
                mb.prompt_len,
                runs,
                temperature,
                with_entropy,
                through_forward=sharing == "forward",
                extra=extra,
                top_k=top_k,
            )
        if sharing == "parts" and len(runs) < len(mb) and mb.prompt_len > 1:  # a 1-token prompt shares nothing
            return shared_prompt_logprobs(
                model, mb.input_ids, mb.attention_mask, mb.prompt_len, runs, temperature, with_entropy, extra, top_k
            )
    return completion_logprobs(
        model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature, with_entropy, extra, top_k
    )


@torch.no_grad()
def frozen_logprobs(model, batch: Batch, cfg, backend: Backend, top_k: int = 0):
    """[B, C] float32 log-probs of `batch`'s completions under a frozen model the backend holds
    (the teacher), micro-batch by micro-batch, computed as the reference's are; with `top_k`,
    also its k likeliest tokens at each position from the same pass: ([B, C], [B, C, k] ids,
    [B, C, k] log-probs). On the CPU."""
    shape = batch.completion_mask.shape
    outs = [torch.zeros(shape)]
    if top_k:
        outs += [torch.zeros(*shape, top_k, dtype=torch.long), torch.zeros(*shape, top_k)]
    size, sharing = cfg.train.micro_batch_size, prompt_sharing(cfg, backend)
    temperature = cfg.rollout.temperature or 1.0
    for start, mb in zip(range(0, len(batch), size), micro_batches(batch, size)):
        mb = mb.to(backend.device)
        with backend.autocast():
            parts = sequence_logprobs(model, mb, temperature, sharing=sharing, top_k=top_k)
        parts = parts if top_k else (parts,)
        rows, cols = slice(start, start + len(mb)), slice(0, parts[0].shape[1])
        for out, part in zip(outs, parts):
            out[rows, cols] = part.cpu()
    return tuple(outs) if top_k else outs[0]


def reference_logprobs(model, ref_model, mb: Batch, temperature: float, sharing: str | None = None) -> torch.Tensor:
    """log-probs under the reference: a separate copy, or the base model under LoRA."""
    ctx = model.disable_adapter() if ref_model is None else nullcontext()
    with ctx:
        return sequence_logprobs(ref_model or model, mb, temperature, sharing=sharing)


def advantages_first(cfg) -> bool:
    """The advantages need no log-probs (no KL in the reward): computed before the prepass,
    which then leaves out the rows they zero."""
    return not cfg.algo.kl_in_reward


@torch.no_grad()
def logprob_prepass(batch: Batch, cfg, backend: Backend) -> float:
    """Fill batch.old_logprobs (needed when the policy moves before a row is trained on, or
    for the KL reward) and batch.ref_logprobs (beta > 0), micro-batch by micro-batch. Where the
    update leaves zero-advantage rows out (`why_nothing_is_skipped`), so does the old pass (their
    old log-probs stay 0: nothing reads them); batch.advantages must then be the round's.
    Returns the forward passes made, in whole batches (a share of the loss tokens for a pass
    that left rows out)."""
    a = cfg.algo
    # the policy moves before a row is trained on, or the KL reward needs them. (Stale rows of
    # async generation need none either when a round makes one update: their proximal policy
    # is then the trainer's own forward pass, detached; docs/algorithms.md)
    need_old = a.num_iterations > 1 or a.steps_per_generation > 1 or a.kl_in_reward
    if not need_old and a.beta == 0:
        return 0.0
    model, ref_model = backend.module, backend.ref_model
    temperature = cfg.rollout.temperature or 1.0
    old = torch.zeros_like(batch.completion_mask, dtype=torch.float32)
    ref = torch.zeros_like(old)
    sharing = prompt_sharing(cfg, backend)
    size = cfg.train.micro_batch_size
    order, part = torch.arange(len(batch)), batch
    if advantages_first(cfg) and why_nothing_is_skipped(cfg) is None:  # (beta is 0 there)
        order, _ = informative_rows(batch, size)
        part = batch.map(lambda t: t[order])
    for start, mb in zip(range(0, len(part), size), micro_batches(part, size)):
        mb = mb.to(backend.device)
        rows, cols = order[start : start + len(mb)], slice(0, mb.completion_mask.shape[1])
        with backend.autocast():
            if need_old:
                old[rows, cols] = sequence_logprobs(model, mb, temperature, sharing=sharing).float().cpu()
            if a.beta > 0:
                ref[rows, cols] = reference_logprobs(model, ref_model, mb, temperature, sharing).float().cpu()
    batch.old_logprobs = old if need_old else None
    batch.ref_logprobs = ref if a.beta > 0 else None
    share = float(part.completion_mask.sum() / batch.completion_mask.sum().clamp(min=1))
    return share * need_old + float(a.beta > 0)


def step_advantages(
    groups: list[Group], batch: Batch, cfg, reward_names: list[str], weights: list[float]
) -> torch.Tensor:
    """This process's advantages from every reward (None -> NaN): [B], or [B, C] when they vary
    along the completion (REINFORCE++ with the KL in the reward). Rewards of every process's
    groups are gathered first, so batch statistics see the whole round, exactly as in one
    process. With `kl_in_reward` the KL penalty is one more reward (weight beta, summed over the
    completion), or for REINFORCE++ a reward on every token."""
    if not reward_names:  # a teacher alone (plait check allows no reward only then): its advantage is all
        return torch.zeros(len(batch))
    nan = float("nan")
    per_reward = torch.tensor(
        [[[nan if v is None else v for v in g.rewards[name]] for g in groups] for name in reward_names],
        dtype=torch.float32,
    )
    w = torch.tensor(weights, dtype=torch.float32)
    a = cfg.algo
    estimator, token_level = a.advantage_estimator, a.advantage_estimator in TOKEN_WHITENED
    scale = a.scale_rewards or DEFAULT_SCALE[estimator]
    if a.kl_in_reward and not token_level:
        seq_kl = sequence_kl(batch.old_logprobs, batch.ref_logprobs, batch.completion_mask, a.kl_estimator)
        per_reward = torch.cat([per_reward, -seq_kl.reshape(1, len(groups), -1)])
        w = torch.cat([w, torch.tensor([a.beta])])
    everyone = comm.all_gather_rows(per_reward, dim=1)  # [R, groups of all processes, n]
    mine = slice(comm.rank() * len(groups), (comm.rank() + 1) * len(groups))
    if a.reward_aggregation != "sum_then_normalize":  # GDPO normalizes each reward first (grpo only)
        return combine_rewards(everyone, w, a.reward_aggregation, scale)[mine].reshape(-1)
    lengths = comm.all_gather_rows(batch.completion_mask.sum(1).float().reshape(len(groups), -1))
    adv = ESTIMATORS[estimator](weighted_total(everyone, w), lengths, scale)[mine].reshape(-1)
    if token_level:
        adv = reinforce_pp_advantages(adv, batch, cfg, scale)
    return torch.nan_to_num(adv, nan=0.0)


def reinforce_pp_advantages(scores: torch.Tensor, batch: Batch, cfg, scale: str) -> torch.Tensor:
    """REINFORCE++'s token returns whitened over the loss tokens of every process's scored
    completions: [B] when every token of a completion has the same return, else [B, C]."""
    a = cfg.algo
    mask = batch.completion_mask.float() * (~scores.isnan())[:, None]
    token_kl = KL_ESTIMATORS[a.kl_estimator](batch.old_logprobs, batch.ref_logprobs) if a.kl_in_reward else None
    returns = reinforce_pp_returns(torch.nan_to_num(scores, nan=0.0), mask, token_kl, a.beta)
    sums = comm.all_sum([float(mask.sum()), float(returns.double().sum()), float((returns.double() ** 2).sum())])
    if token_kl is None:
        return whiten(scores, sums, scale)  # NaN stays NaN: unscored rows get 0
    return whiten(returns, sums, scale) * mask


# ---------------------------------------------------------------- what an update measures
# Token means are over `measured_tokens` (the loss tokens that went through the model): rows
# left out of the forward pass have none.


@dataclass(kw_only=True)
class MicroBatchStats:
    """Sums over one micro-batch's real tokens, measured beside the loss."""

    logprob_gap_tokens: torch.Tensor = stat("logprob_gap", per="measured_tokens")  # engine vs trainer, |diff|
    entropy_tokens: torch.Tensor = stat("entropy", per="measured_tokens")  # always logged, as TRL does
    # tokens whose policy term counts, of all the update's (train.top_entropy_quantile drops some)
    trained_tokens: torch.Tensor = stat("tokens/trained_share", per="real_tokens")
    # log pi_student - log pi_teacher of the sampled tokens: the reverse KL to the teacher, estimated
    # under the student's samples (None: no teacher)
    teacher_kl_tokens: torch.Tensor | None = stat("teacher/kl", per="measured_tokens", optional=True)
    # teacher.top_k: the forward KL from the teacher's renormalized top k to the student, its loss term
    teacher_top_k_kl_tokens: torch.Tensor | None = stat("teacher/top_k_kl", per="measured_tokens", optional=True)


@dataclass(kw_only=True)
class EngineMismatch:
    """Sums over one micro-batch's real tokens of the engine-vs-trainer mismatch (None: the
    correction, algo.engine_is_correction, is off)."""

    engine_kl_tokens: torch.Tensor = stat("engine/kl", per="measured_tokens")
    engine_is_masked_tokens: torch.Tensor | None = stat("engine/is_masked", per="measured_tokens", optional=True)
    engine_is_truncated_tokens: torch.Tensor | None = stat("engine/is_truncated", per="measured_tokens", optional=True)
    engine_is_weight_tokens: torch.Tensor | None = stat("engine/is_weight", per="measured_tokens", optional=True)


@dataclass(kw_only=True)
class FirstUpdate:
    """The round's first update alone (None in the others), whose log-probs come from the
    weights before any update of the round: in a synchronous round, the weights that sampled
    it (the drift guard's)."""

    first_update_gap_tokens: torch.Tensor | None = stat(
        "logprob_gap/before_update", per="first_update_tokens", optional=True
    )
    first_update_tokens: float | None = stat(optional=True)


@dataclass(kw_only=True)
class ChunkStats:
    """The rows of one update on this process."""

    real_tokens: float = stat(across="same")  # the update's loss tokens, over all processes already
    # loss tokens that went through forward and backward, of all (the rest were left out: MFU counts them not)
    measured_tokens: float = stat("update/forwarded_share", per="real_tokens")
    rows: float = stat()
    skipped_rows: float = stat("update/skipped_rows", per="rows")
    processed_tokens: float = stat("tokens/processed", across="own")  # this process's, prompts included


@dataclass(kw_only=True)
class StepStats:
    """One optimizer update's outcome (the same on every process)."""

    updates: float = stat(across="same")
    lr: float = stat("lr", per="updates", across="same")
    # completions with a non-zero advantage, of the update's (train.lr_by_signal scales the step by it)
    signal_share: float = stat("update/signal_share", per="updates", across="same")
    nonfinite_steps: float = stat("nonfinite_steps", across="same")
    applied_steps: float = stat(across="same")
    grad_norm: float = stat("grad_norm", per="applied_steps", across="same")  # 0 for a skipped update
    ref_syncs: float | None = stat("ref_syncs", across="same", optional=True)  # None: no reference syncs


def train_micro_batch(
    model, mb: Batch, counts: StepCounts, cfg, settings: LossSettings, backend: Backend
) -> tuple[LossOutputs, MicroBatchStats, EngineMismatch]:
    """Forward, loss and backward for one micro-batch; returns its statistics."""
    a = cfg.algo
    # the entropy is always logged (as TRL does); it carries a gradient only when the loss uses it
    with_entropy = True if a.top_entropy_quantile < 1 or a.entropy_coeff > 0 else "logged"
    with backend.autocast():
        logp, entropy = sequence_logprobs(
            model, mb, cfg.rollout.temperature or 1.0, with_entropy, prompt_sharing(cfg, backend), mb.teacher_top_ids
        )
    logp, entropy = logp.float(), entropy.float()
    student_top = None  # teacher.top_k: the student's log-probs of the teacher's top k tokens
    if mb.teacher_top_ids is not None:
        logp, student_top = logp[..., 0], logp[..., 1:]
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()  # one pass: ratio is exactly 1
    mask = mb.completion_mask
    keep = None  # tokens whose policy term counts (all of them unless filtered by entropy)
    if a.top_entropy_quantile < 1:
        keep = high_entropy_mask(entropy.detach(), mask, a.top_entropy_quantile)
    weights = None
    if a.engine_is_correction:
        weights = engine_mismatch_weights(
            old, mb.sampling_logprobs, mask, a.engine_is_mode, a.engine_is_cap, a.engine_is_min
        )
    bonus = entropy if with_entropy is True else None
    advantages, teacher_kl, top_k_kl = mb.advantages, None, None
    if mb.teacher_logprobs is not None:  # the student's log-probs before this round's updates
        if student_top is None:  # the sampled-token estimate, as an advantage on every token
            advantages = with_teacher(advantages, old, mb.teacher_logprobs, mask, cfg.teacher.weight)
        teacher_kl = ((old - mb.teacher_logprobs) * mask).sum()
    outputs = policy_loss(
        logp, old, advantages, mask, counts, settings, mb.ref_logprobs, bonus, weights, policy_mask=keep
    )
    loss = outputs.loss
    if student_top is not None:  # a loss term of its own, a token mean over the step
        kl = top_k_distillation(student_top, mb.teacher_top_logprobs) * mask
        loss = loss + cfg.teacher.weight * kl.sum() / max(counts.tokens, 1)
        top_k_kl = kl.detach().sum()
    backend.backward(loss)
    real = mb.completion_mask.float()
    measured = MicroBatchStats(
        logprob_gap_tokens=((logp.detach() - mb.sampling_logprobs).abs() * real).sum(),
        entropy_tokens=(entropy.detach() * real).sum(),
        trained_tokens=(mask if keep is None else keep).float().sum(),
        teacher_kl_tokens=teacher_kl,
        teacher_top_k_kl_tokens=top_k_kl,
    )
    return outputs, measured, engine_mismatch(old, mb.sampling_logprobs, real, weights, a.engine_is_mode)


def engine_mismatch(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, real: torch.Tensor, weights: torch.Tensor | None, mode: str
) -> EngineMismatch:
    """Per-token sums that measure the engine-vs-trainer mismatch: the KL of the trainer from the
    engine that sampled (k3 estimate, unbiased under the engine's samples) and, with the
    correction (`weights`, in `mode`) on, the tokens it truncated or masked and its mean weight."""
    log_ratio = engine_log_ratio(trainer_logp, engine_logp, real)
    kl_tokens = ((torch.expm1(log_ratio) - log_ratio) * real).sum()
    if weights is None:
        return EngineMismatch(engine_kl_tokens=kl_tokens)
    raw = torch.exp(log_ratio.sum(-1, keepdim=True) if mode.startswith("sequence") else log_ratio)
    weights = weights.expand_as(real)
    changed = (weights != raw.expand_as(real)) * real
    return EngineMismatch(
        engine_kl_tokens=kl_tokens,
        engine_is_masked_tokens=(changed * (weights == 0)).sum(),
        engine_is_truncated_tokens=(changed * (weights != 0)).sum(),
        engine_is_weight_tokens=(weights * real).sum(),
    )


def why_nothing_is_skipped(cfg) -> str | None:
    """Why a completion with zero advantage still changes the update (None: it doesn't): a
    term of the loss that does not multiply the advantage, or a normalizer that depends on the
    micro-batch the row shares."""
    a = cfg.algo
    if not cfg.train.skip_zero_advantage:
        return "train.skip_zero_advantage is off"
    if cfg.teacher is not None:
        return "the teacher's advantage is on every token"
    if a.beta > 0:
        return "the KL penalty in the loss (algo.beta) has a gradient on every row"
    if a.entropy_coeff > 0:
        return "the entropy bonus (algo.entropy_coeff) has a gradient on every row"
    if a.top_entropy_quantile < 1:
        return "the entropy filter (algo.top_entropy_quantile) ranks tokens across the micro-batch"
    if a.loss_type == "bnpo":
        return "bnpo's normalizer is each micro-batch's token count"
    if cfg.train.deterministic:  # equal within float rounding is not bit for bit
        return "train.deterministic trains every row, so its runs compare bit for bit with the recorded references"
    return None


def signal_rows(chunk: Batch) -> torch.Tensor:
    """Which of `chunk`'s rows carry a gradient: a non-zero advantage on a loss token (with a
    teacher, every row with a loss token: its advantage is on every token)."""
    if chunk.teacher_logprobs is not None:
        return (chunk.completion_mask != 0).any(-1)
    adv = chunk.advantages if chunk.advantages.dim() == 2 else chunk.advantages[:, None]
    return ((adv != 0) & (chunk.completion_mask != 0)).any(-1)


def informative_rows(chunk: Batch, mb_size: int) -> tuple[torch.Tensor, int]:
    """The indices of `chunk`'s rows that can change the update (a nonzero advantage on a loss
    token), in their order, and how many there are. Every process keeps the same number of
    micro-batches (sharded backends gather weights per forward), at least one (so the backend's
    step sees a gradient, zero if need be): a process with fewer informative rows fills up with
    as few uninformative ones as that takes (one per missing micro-batch), which add exact zeros."""
    useful = signal_rows(chunk)
    kept = int(useful.sum())
    n_mbs = int(comm.all_max([max(1, -(-kept // mb_size))])[0])
    rows = max(kept, (n_mbs - 1) * mb_size + 1)  # the fewest that still make n_mbs micro-batches
    return torch.cat([useful.nonzero().flatten(), (~useful).nonzero().flatten()])[:rows], kept


def informative_first(chunk: Batch, mb_size: int) -> tuple[Batch, int]:
    """`chunk` cut to its informative rows (informative_rows), and how many it kept."""
    order, kept = informative_rows(chunk, mb_size)
    return chunk.map(lambda t: t[order]), kept


def accumulate_gradients(
    chunk: Batch,
    cfg,
    settings: LossSettings,
    backend: Backend,
    timer: PhaseTimer,
    sums: Sums,
    first: bool = False,
) -> float:
    """Forward and backward over `chunk`'s micro-batches: the gradient of one update, its
    statistics added to `sums` (`first`: the round's first update). The loss is normalized by
    the update's counts over all processes, so gradients sum over them. Rows that can't change
    the gradient are left out where nothing else depends on them (`why_nothing_is_skipped`);
    the counts stay the whole chunk's. Returns the share of the update's rows (over all
    processes) that carry a gradient."""
    size = cfg.train.micro_batch_size
    signal = float(signal_rows(chunk).sum())
    seqs, toks, n_mbs, signal = comm.all_sum(
        [len(chunk), float(chunk.completion_mask.sum()), -(-len(chunk) // size), signal]
    )
    counts = StepCounts(int(seqs), int(toks), int(n_mbs), cfg.rollout.max_completion_length)
    trained = chunk
    if why_nothing_is_skipped(cfg) is None:
        trained, _ = informative_first(chunk, size)
    mbs = [mb.to(backend.device) for mb in micro_batches(trained, size)]
    with timer("train"), backend.keep_casts():
        for i, mb in enumerate(mbs):
            with backend.accumulate(last=i == len(mbs) - 1):
                outputs, measured, engine = train_micro_batch(backend.model, mb, counts, cfg, settings, backend)
                before = FirstUpdate(first_update_gap_tokens=measured.logprob_gap_tokens) if first else None
                sums.add(outputs, measured, engine, before)
    forwarded = float(trained.completion_mask.sum())  # this process's forwarded loss tokens
    update_rows = ChunkStats(
        real_tokens=toks,
        measured_tokens=forwarded,
        rows=float(len(chunk)),
        skipped_rows=float(len(chunk) - len(trained)),
        processed_tokens=float(trained.attention_mask.sum()),
    )
    sums.add(update_rows, FirstUpdate(first_update_tokens=forwarded) if first else None)
    return signal / max(1.0, seqs)


def step_stats(
    outcome: StepOutcome, share: float, guard: NonFiniteGuard, round_: int, syncs_reference: bool
) -> StepStats:
    """One update's outcome as statistics; the guard stops a run that keeps skipping."""
    applied = guard.check(outcome.applied, outcome.grad_norm, round_)
    return StepStats(
        updates=1.0,
        lr=outcome.lr,
        signal_share=share,
        nonfinite_steps=float(not applied),
        applied_steps=float(applied),
        grad_norm=outcome.grad_norm if applied else 0.0,  # a skipped update's norm is not finite
        ref_syncs=float(applied and outcome.reference_synced) if syncs_reference else None,
    )


def policy_update(
    batch: Batch,
    cfg,
    backend: Backend,
    guard: NonFiniteGuard | None = None,
    step: int = 0,
    timer: PhaseTimer | None = None,
    hashes: RoundHashes | None = None,
    lr_scale: float = 1.0,
) -> dict[str, float]:
    """num_iterations passes over the round's batch, each split into steps_per_generation
    optimizer updates. An update with a non-finite gradient is skipped by the backend; `guard`
    counts it. Timed as `train` (forward + backward) and `optimizer` (clip + update). With
    `hashes`, the gradient of the round's first update is hashed into it (train.deterministic).
    Every update runs at `lr_scale` x the schedule's rate (recovery's lowered rate), and with
    train.lr_by_signal also x the share of its completions that carry a gradient."""
    a = cfg.algo
    guard = guard or NonFiniteGuard(cfg.train.max_nonfinite_steps)
    timer = timer or PhaseTimer()
    settings = LossSettings.from_algo(a)
    rows = len(batch) // a.steps_per_generation
    sums = Sums()
    for iteration in range(a.num_iterations):
        for part in range(a.steps_per_generation):
            chunk = batch.slice(part * rows, (part + 1) * rows)
            first = iteration == 0 and part == 0
            share = accumulate_gradients(chunk, cfg, settings, backend, timer, sums, first)
            scale = lr_scale * (share if cfg.train.lr_by_signal else 1.0)
            if first and hashes is not None:
                with timer("hashes"):
                    hashes.add_gradient(backend.module)
            with timer("optimizer"), scaled_lr(backend.scheduler, scale):
                outcome = backend.step(cfg.train.max_grad_norm)
            outcome = replace(outcome, lr=outcome.lr * scale)
            sums.add(step_stats(outcome, share, guard, step, bool(a.ref_model_sync_steps)))
    return sums.metrics(comm.all_sum)
