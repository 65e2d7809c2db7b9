"""The end-of-run advice: when one phase dominates the step, what to change first; and what the
learning curves say (a reward past its peak, collapsing entropy, climbing clip fraction or
gradient norm), with what to try."""

from __future__ import annotations

import torch

from plait.models import native_bf16_cpu
from plait.types import round_of


DOMINANT = 0.5  # a phase above this share of step time gets a suggestion


def _generate(cfg) -> str:
    r = cfg.rollout
    tips = []
    if r.engine == "hf":
        tips.append("rollout.engine=vllm (docs/vllm.md)")
    if r.engine == "hf" and r.precision in ("auto", "fp32") and not _on_gpu(cfg) and native_bf16_cpu():
        tips.append("rollout.precision=bf16 (this CPU multiplies bf16 natively; its gap to the trainer is corrected)")
    tips.append(f"a shorter rollout.max_completion_length (now {r.max_completion_length})")
    tips.append(f"fewer rollout.num_generations (now {r.num_generations})")
    return "consider " + ", ".join(tips)


def _on_gpu(cfg) -> bool:
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def _train(cfg) -> str:
    t = cfg.train
    tips = []
    if t.precision == "fp32" and _on_gpu(cfg):
        tips.append("train.precision=bf16 on a GPU with bf16")
    elif t.precision == "fp32" and native_bf16_cpu():
        tips.append("train.precision=bf16 (this CPU multiplies bf16 natively: docs/vs-trl.md)")
    if cfg.model.gradient_checkpointing:
        tips.append("model.gradient_checkpointing=false if memory allows (it recomputes the forward)")
    tips.append(f"a larger train.micro_batch_size (now {t.micro_batch_size}) if memory allows")
    if cfg.model.lora is None:
        tips.append("model.lora (fewer weight gradients)")
    tips.append("more training processes")
    return "consider " + ", ".join(tips)


SUGGESTIONS = {
    "generate": _generate,
    "train": _train,
    "optimizer": lambda cfg: (
        "the optimizer step: shard it over more processes (train.backend=fsdp2 or deepspeed), "
        "or train LoRA adapters (model.lora)"
    ),
    "score": lambda cfg: (
        "the reward functions: make slow ones async (judges), give them a timeout_s, "
        "or cheapen them (reward/NAME/seconds shows which)"
    ),
    "logprobs": lambda cfg: (
        "the log-prob pre-pass (old-policy and reference log-probs): algo.beta=0 skips the reference, "
        "algo.num_iterations=1 and algo.steps_per_generation=1 skip the old log-probs; "
        "with LoRA the reference is the base model (no second copy)"
    ),
    "weight_sync": lambda cfg: (
        "copying weights to the generation engine: larger rollout.vllm.sync_bucket_mb, "
        "or fewer updates per generation (algo.steps_per_generation)"
    ),
    "checkpoint": lambda cfg: "checkpointing: checkpoint.async_save=true, or a larger checkpoint.save_steps",
    "eval": lambda cfg: "evaluation: a larger eval.every_steps, or fewer eval prompts (data.num_eval)",
    "idle": lambda cfg: "time outside every phase: processes waiting for each other (uneven work), or logging",
}


def suggestion(shares: dict[str, float], cfg) -> str | None:
    """One line about the phase that takes more than half the step, or None."""
    if not shares:
        return None
    phase, share = max(shares.items(), key=lambda kv: kv[1])
    if share < DOMINANT or phase not in SUGGESTIONS:
        return None
    return f"{phase} is {share:.0%} of step time: {SUGGESTIONS[phase](cfg)}"


# ---------------------------------------------------------------- learning health

MIN_ROUNDS = 6  # fewer rounds say nothing about trends


def _smooth(values: list[float]) -> list[float]:
    """A trailing moving average over about a tenth of the run (at least 3 rounds)."""
    w = max(3, len(values) // 10)
    return [sum(values[max(0, i - w + 1) : i + 1]) / len(values[max(0, i - w + 1) : i + 1]) for i in range(len(values))]


def _thirds(values: list[float]) -> tuple[float, float]:
    n = max(1, len(values) // 3)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def _entropy_knobs(history: list[dict], lower_lr: str) -> str:
    """Clip-higher lets low-probability tokens grow, but only where the ratio is clipped at all:
    a run whose every update starts on-policy (one update a round) never clips, and the knob
    would change nothing."""
    if any((m.get("clip/fraction") or 0) > 0 for m in history):
        return f"clip-higher (algo.epsilon_high > algo.epsilon), an entropy bonus (algo.entropy_coeff), or {lower_lr}"
    return (
        f"an entropy bonus (algo.entropy_coeff) or {lower_lr}; not clip-higher: no token was clipped "
        "in any round (each update started from the weights that sampled it), so it would change nothing"
    )


NEAR_CEILING = 0.8  # "converged": the reward has covered this share of the way to the most a completion earned


def reward_ceiling(history: list[dict]) -> float | None:
    """The most one completion earned in the run (None: not logged), the nearest thing to what
    the reward can pay that a run shows."""
    tops = [m["reward/total/max"] for m in history if m.get("reward/total/max") is not None]
    return max(tops) if tops else None


def _accuracy(m: dict, metric: str | None) -> float | None:
    value = m.get("accuracy")
    return value if value is not None or not metric else m.get(f"reward/{metric}/mean")


def equal_groups_split(history: list[dict], metric: str | None = None) -> tuple[float, float] | None:
    """(all right, all wrong): the shares of the last third's groups whose every completion was
    right, or wrong. From the logged split; in records without it, bounds from the accuracy
    where they decide (accuracy a: at most a of the groups can be all right, at most 1 - a all
    wrong, so of the equal share E at least E - a are all wrong): then the larger share is the
    least it can be and the smaller the most. None: unknown, or undecided."""
    tail = history[-max(1, len(history) // 3) :]
    if all(m.get("groups/all_wrong") is not None for m in tail):
        return _mean(m["groups/all_right"] for m in tail), _mean(m["groups/all_wrong"] for m in tail)
    acc = [_accuracy(m, metric) for m in tail]
    equal = [m.get("groups/all_equal") for m in tail]
    if None in acc or None in equal:
        return None
    a, e = _mean(acc), _mean(equal)
    if e - a > a:
        return a, e - a
    if e - (1 - a) > 1 - a:
        return e - (1 - a), 1 - a
    return None


def _mean(values) -> float:
    values = list(values)
    return sum(values) / max(1, len(values))


def converged(history: list[dict], metric: str | None = None) -> bool:
    """The reward rose, ended at its best (smoothed, within 2%) and near what a completion can
    earn (the way from the first third to the run's best completion covered to NEAR_CEILING;
    in records without it, the accuracy at 0.8 or more where logged): falling entropy and equal
    groups are then the policy settling on what earns the reward, not a collapse. One good last round is not
    that, nor equal groups that are all wrong."""
    rewards = [m["reward/total/mean"] for m in history if m.get("reward/total/mean") is not None]
    if len(rewards) < MIN_ROUNDS:
        return False
    smooth = _smooth(rewards)
    first, last = _thirds(rewards)
    if not (last > first and smooth[-1] >= max(smooth) - 0.02 * abs(max(smooth))):
        return False
    split = equal_groups_split(history, metric)
    if split is not None and split[1] > split[0]:
        return False
    ceiling = reward_ceiling(history)
    if ceiling is not None:
        return ceiling > first and last - first >= NEAR_CEILING * (ceiling - first)
    acc = [a for a in (_accuracy(m, metric) for m in history) if a is not None]
    if len(acc) >= MIN_ROUNDS:
        return _thirds(acc)[1] >= NEAR_CEILING
    return True  # a record with neither: the rise to the best is all it shows


def _entropy_note(first: float, last: float, lr: str, history: list[dict], metric: str | None = None) -> str:
    if converged(history, metric):
        return (
            f"entropy fell ({first:.3f} -> {last:.3f}, first vs last third) as the reward rose to its best and "
            "stayed there: the policy converged on what earns it. More rounds teach it little (stop, or harder "
            "data); if the held-out score did not rise with it, the reward pays for something else"
        )
    return (
        f"entropy collapsed ({first:.3f} -> {last:.3f}, first vs last third): the policy is "
        f"settling on few answers. Try {_entropy_knobs(history, lr)}"
    )


def _all_equal_note(first: float, last: float, lr: str, history: list[dict], metric: str | None = None) -> str:
    head = (
        f"{last:.0%} of the groups in the last third of the run had all-equal rewards (first third "
        f"{first:.0%}): they carry no gradient. "
    )
    split = equal_groups_split(history, metric)
    if split is not None and split[1] > split[0]:
        return head + (
            f"Most are all wrong ({split[1]:.0%} of the groups every completion wrong, {split[0]:.0%} every one "
            "right): a dead run, not a solved one: on those prompts the policy no longer samples a right answer. "
            f"Try {lr}, worked examples (data.examples), easier prompts, more rollout.num_generations, or "
            "algo.dynamic_sampling=true; recovery.enabled=true rolls a falling run back to its best evaluation"
        )
    if converged(history, metric):
        return head + "The reward ended near the most a completion earned: the task is solved (stop, or harder data)"
    return head + (
        "Read samples.jsonl: groups all right are prompts the policy has mastered (stop, or harder data); all "
        "wrong, prompts out of its reach or a reward it cannot earn. algo.dynamic_sampling=true draws more groups "
        "until they differ"
    )


# (metric, fires(first third's mean, last third's), the note(first, last, "a lower learning rate", history,
# the evaluation's metric))
TRENDS = (
    ("entropy", lambda first, last: first > 0 and last < 0.2 * first, _entropy_note),
    ("groups/all_equal", lambda first, last: last >= 0.8 and last > first, _all_equal_note),
    (
        "clip/fraction",
        lambda first, last: last > 0.2 and last > 2 * first,
        lambda first, last, lr, history, metric=None: (
            f"the clipped share of tokens climbed ({first:.2f} -> {last:.2f}): updates move the "
            f"policy too far. Try {lr} or fewer algo.num_iterations"
        ),
    ),
    (
        "completion/truncated",
        lambda first, last: last >= 0.5 and last >= first + 0.3,
        lambda first, last, lr, history, metric=None: (
            f"the share of completions cut at rollout.max_completion_length climbed ({first:.0%} -> {last:.0%}, "
            "first vs last third): read samples.jsonl. Text that repeats itself to the cap is a policy that "
            f"degraded: try {lr}. Reasoning that grew longer needs a larger rollout.max_completion_length, "
            "or algo.mask_truncated_completions=true, or the soft_overlong_punishment reward"
        ),
    ),
    (
        "teacher/kl",
        lambda first, last: last > first > 0 or (first <= 0 < last),
        lambda first, last, lr, history, metric=None: (
            f"the KL to the teacher rose ({first:.4f} -> {last:.4f}, first vs last third): the student moves away "
            f"from the teacher. Try {lr} or a smaller teacher.weight beside the rewards"
        ),
    ),
    (
        "grad_norm",
        lambda first, last: first > 0 and last > 3 * first,
        lambda first, last, lr, history, metric=None: (
            f"the gradient norm climbed ({first:.3g} -> {last:.3g}, first vs last third): "
            f"training is getting unstable. Try {lr} or a smaller train.max_grad_norm"
        ),
    ),
)


EARLY_ROUND = 4  # the round at which a run that has not started learning is told so


def early_note(history: list[dict], metric: str | None = None) -> str | None:
    """Said at round EARLY_ROUND, not at the end: a run whose groups have all been equal and
    mostly all wrong, or whose reward has not risen since round 1, is not learning yet."""
    if len(history) != EARLY_ROUND:
        return None
    if history[0].get("teacher/kl") is not None:  # distillation: equal groups still carry the teacher's gradient
        return _early_teacher_note(history)
    rewards = [m.get("reward/total/mean") for m in history]
    equal = [m.get("groups/all_equal") for m in history]
    if None in rewards or None in equal:
        return None
    wrong = [m.get("groups/all_wrong") for m in history]
    acc = [_accuracy(m, metric) for m in history]
    dead = min(equal) >= 0.9 and (
        (None not in wrong and _mean(wrong) >= 0.5) or (None not in acc and _mean(acc) <= 0.05)
    )
    late = _mean(rewards[-2:])
    if dead:
        head = f"rounds 1-{EARLY_ROUND}: {_mean(equal):.0%} of the groups gave equal rewards, nearly all of them wrong"
    elif late <= rewards[0]:
        head = (
            f"rounds 1-{EARLY_ROUND}: the reward has not risen ({rewards[0]:.3f} in round 1, {late:.3f} over the last "
            f"two; {_mean(equal):.0%} of the groups equal)"
        )
    else:
        return None
    return head + (
        ": the policy is not learning yet. Read samples.jsonl; then try worked examples (data.examples), easier "
        "prompts, more rollout.num_generations or a higher rollout.temperature, algo.dynamic_sampling=true, and "
        "check that the reward can pay a completion the model writes"
    )


def _early_teacher_note(history: list[dict]) -> str | None:
    """A distillation run whose KL to the teacher has not fallen since round 1."""
    kl = [m["teacher/kl"] for m in history]
    late = _mean(kl[-2:])
    if late < kl[0]:
        return None
    return (
        f"rounds 1-{EARLY_ROUND}: the KL to the teacher has not fallen ({kl[0]:.4f} in round 1, {late:.4f} over the "
        "last two): the student is not moving toward the teacher yet. Try a higher train.learning_rate or "
        "teacher.weight, and check that the teacher answers the prompts well (plait eval on its folder)"
    )


def _guard_advice(cfg, history: list[dict] = (), evals: list[dict] = ()) -> str:
    """What keeps the best of a run that fell: recovery where it is off; where it is on, what it
    did (its rollbacks, the state the run ended on) or, when it did not act, a margin it acts on
    sooner."""
    r = getattr(cfg, "recovery", None)
    if r is not None and r.enabled:
        watch = r.watch if r.watch != "auto" else ("eval" if cfg.eval.every_steps else "reward")
        margin = f"margin {r.margin:g}" + (f", relative {r.relative_margin:g}" if r.relative_margin is not None else "")
        rollbacks = max((m.get("recovery/rollbacks") or 0 for m in history), default=0)
        restored = [e["restored"] for e in evals if e.get("restored") is not None]
        if rollbacks or restored:
            ended = f", and the run ended on round {restored[-1]}'s state (final/)" if restored else ""
            return (
                f"recovery (watching the {watch}, {margin}) rolled back {int(rollbacks)} time(s){ended}; a run "
                f"that keeps falling after its rollbacks needs a lower rate from the start"
            )
        return f"recovery is on (watching the {watch}, {margin}) and did not act: a smaller margin acts sooner"
    return (
        "recovery.enabled=true rolls a falling run back to its best state (or checkpoint.keep_best=true keeps "
        "the best evaluated model)"
    )


def health_notes(history: list[dict], evals: list[dict], cfg, metric: str | None = None) -> list[str]:
    """What the run's curves say about its learning, with what to try: a reward that fell far
    from its peak, an evaluation that ended below its best, entropy that collapsed, clip
    fraction, truncated share or gradient norm climbing. [] for a healthy (or too short) run."""
    notes = []
    lr = cfg.train.learning_rate if cfg is not None else None
    lower_lr = f"a lower train.learning_rate (now {lr:g})" if lr else "a lower learning rate"
    rounds = [  # a run's in-memory history has no round number: its position says it
        round_of(m) if ("round" in m or "step" in m) else i + 1
        for i, m in enumerate(history)
        if "reward/total/mean" in m
    ]
    rewards = [m["reward/total/mean"] for m in history if "reward/total/mean" in m]
    if len(rewards) >= MIN_ROUNDS:
        smooth = _smooth(rewards)
        top = max(range(len(smooth)), key=smooth.__getitem__)
        rise = smooth[top] - min(smooth[: top + 1])
        fall = smooth[top] - smooth[-1]
        if rise > 0 and fall >= 0.5 * rise and top < len(smooth) - 1:
            notes.append(
                f"the reward fell from its peak ({smooth[top]:.3f}, smoothed, around round {rounds[top]}) to "
                f"{smooth[-1]:.3f} at the end: the policy degraded. Try {lower_lr}, a KL term (algo.beta > 0), "
                f"and {_guard_advice(cfg, history, evals)}"
            )
    scored = [(round_of(e), e[metric]) for e in evals if metric and e.get(metric) is not None]
    if len(scored) >= 2:
        best = max(scored, key=lambda e: e[1])
        if scored[-1][1] < best[1] - 0.05:
            notes.append(
                f"the evaluation ({metric}) peaked at {best[1]:.3f} (round {best[0]}) and ended at "
                f"{scored[-1][1]:.3f}: {_guard_advice(cfg, history, evals)}; try {lower_lr}"
            )
    notes += takeover_notes(history, cfg)
    distilling = any(m.get("teacher/kl") is not None for m in history)
    for key, fires, note in TRENDS:
        # the teacher's advantage needs no differing group, and a student that takes on a confident
        # teacher's distribution loses entropy on the way: neither says what they say of RL alone
        if distilling and key in ("groups/all_equal", "entropy"):
            continue
        values = [m[key] for m in history if m.get(key) is not None]
        if len(values) >= MIN_ROUNDS and fires(*_thirds(values)):
            notes.append(note(*_thirds(values), lower_lr, history, metric))
    return notes


def takeover_notes(history: list[dict], cfg) -> list[str]:
    """A reward that fell from its peak while another rose to near its best: the policy earns
    the second at the first's expense (a format reward earned with wrong answers)."""
    if cfg is None or len(cfg.rewards) < 2:
        return []
    curves, rounds = {}, {}
    for r in cfg.rewards:
        key = f"reward/{r.name}/mean"
        rows = [(i, m) for i, m in enumerate(history) if m.get(key) is not None]
        if len(rows) >= MIN_ROUNDS:
            curves[r.name] = _smooth([m[key] for _, m in rows])
            rounds[r.name] = [round_of(m) if ("round" in m or "step" in m) else i + 1 for i, m in rows]
    notes = []
    for name, curve in curves.items():
        top = max(range(len(curve)), key=curve.__getitem__)
        rise, fall = curve[top] - min(curve[: top + 1]), curve[top] - curve[-1]
        if rise < 0.05 or fall < 0.5 * rise:
            continue
        risen = [o for o, c in curves.items() if o != name and len(c) == len(curve) and c[-1] - c[top] >= 0.2]
        if not risen:
            continue
        weights = {r.name: r.weight for r in cfg.rewards}
        other = max(risen, key=lambda o: curves[o][-1] - curves[o][top])
        notes.append(
            f"reward {name} fell from its peak ({curve[top]:.3f}, smoothed, around round {rounds[name][top]}) to "
            f"{curve[-1]:.3f} while {other} rose to {curves[other][-1]:.3f}: the policy earns {other} at {name}'s "
            f"expense. Lower {other}'s weight (now {weights[other]:g}), or reward it only together with {name} "
            "(for answers in \\boxed{}: boxed_accuracy instead of boxed_format)"
        )
    return notes
