"""A run that defends its best (`recovery.enabled`).

After each round the watched score is read: the evaluation (eval.metric, at eval.before and
every eval.every_steps), or the rounds' mean total reward averaged over `recovery.window`
rounds. A new best saves the run's state to RUN_DIR/recovery (a checkpoint like the others:
policy, optimizer, LR schedule, reference). A fall of more than `recovery.margin` below the
best (or, with `recovery.relative_margin`, of more than that share of the best: whichever comes
first) restores that state, multiplies the learning rate by `recovery.lr_factor` and goes on:
the round count and the data position go on, so the rounds after a rollback train on prompts
the policy has not seen (as large pretraining runs restart before a loss spike and skip its
batches). The random generators go on too: the rounds after a rollback sample afresh. After
`recovery.max_recoveries` rollbacks, the next fall restores the best state and ends the run.

What the decisions leave (best score and round, rollbacks so far, the learning-rate scale,
the reward window) is run state: every checkpoint's trainer state holds it, so a run resumed
after a crash makes the same decisions. `decide` is a pure function of it and the score.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from plait.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state


RECOVERY_DIR = "recovery"  # RUN_DIR/recovery/checkpoints/step_N: the best state so far


@dataclass
class RecoveryState:
    best: float | None = None  # the best watched score so far
    best_round: int | None = None  # the round whose state scored it (0: before training)
    rollbacks: int = 0
    lr_scale: float = 1.0  # lr_factor ** rollbacks
    window: list[float] = field(default_factory=list)  # watch=reward: the last rounds' mean rewards

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> RecoveryState:
        return cls(**data) if data else cls()


def watched(cfg) -> str | None:
    """What recovery watches: "eval", "reward", or None (off)."""
    r = cfg.recovery
    if not r.enabled:
        return None
    if r.watch == "auto":
        return "eval" if cfg.eval.every_steps > 0 else "reward"
    return r.watch


def reward_score(state: RecoveryState, mean_reward: float, window: int) -> float | None:
    """watch=reward: the round's mean reward joins the window; the window's mean once it is full."""
    state.window = [*state.window, mean_reward][-window:]
    return sum(state.window) / window if len(state.window) == window else None


def floor(best: float, margin: float, relative_margin: float | None = None) -> float:
    """The lowest score that is not yet a fall from `best`: `margin` below it, or `relative_margin`
    of it below it when that is nearer (a best accuracy of 0.28 may fall 0.028, not 0.1)."""
    lowest = best - margin
    if relative_margin is not None:
        lowest = max(lowest, best - relative_margin * abs(best))
    return lowest


def decide(
    state: RecoveryState, score: float, margin: float, max_recoveries: int, relative_margin: float | None = None
) -> str:
    """ "best" (a new best: keep this state), "rollback", "stop" (a fall past the margin with
    every rollback spent: end the run on the best state) or "keep" (go on)."""
    if state.best is None or score > state.best:
        return "best"
    if score < floor(state.best, margin, relative_margin):
        return "rollback" if state.rollbacks < max_recoveries else "stop"
    return "keep"


def best_checkpoint(run_dir: Path) -> Path | None:
    return latest_checkpoint(Path(run_dir) / RECOVERY_DIR)


def keep_best(run_dir: Path, round_: int, backend, trainer_state: dict) -> None:
    """The state after `round_` as the best (replacing the previous one once it is complete)."""
    save_checkpoint(Path(run_dir) / RECOVERY_DIR, round_, backend, trainer_state, keep_last=1, blocking=True)


def restore_best(run_dir: Path, backend, engine) -> None:
    """The best state's policy, optimizer and reference. What goes on as it was: the LR
    schedule's position (a decay goes on decaying), this process's random generators (the
    rounds after a rollback sample afresh); and the engine's copy of the weights (an engine
    outside the trainer) is copied again."""
    generators, schedule = rng_state(), backend.scheduler.state_dict()
    load_checkpoint(best_checkpoint(run_dir), backend)
    set_rng_state(generators)
    backend.scheduler.load_state_dict(schedule)
    for group, lr in zip(backend.scheduler.optimizer.param_groups, backend.scheduler.get_last_lr()):
        group["lr"] = lr
    while engine is not None:  # wrappers (the tool loop) hold the engine that holds weights
        if hasattr(engine, "version"):
            engine.version = None
        engine = getattr(engine, "engine", None)


def defend(run, round_: int, score: float, trainer_state: Callable[[], dict]) -> bool:
    """recovery.enabled: after round `round_`, whose watched score is `score`, keep its state as
    the best, roll back to the best, or (every rollback spent) restore the best and end the run
    (True). `trainer_state()`: what a checkpoint of the run holds besides the backend's state."""
    rc, state = run.cfg.recovery, run.recovery
    verdict = decide(state, score, rc.margin, rc.max_recoveries, rc.relative_margin)
    if verdict == "keep":
        return False
    with run.timer("checkpoint"):
        if verdict == "best":
            state.best, state.best_round = score, round_
            keep_best(run.run_dir, round_, run.backend, trainer_state())
            return False
        restore_best(run.run_dir, run.backend, run.engine)
    fell = f"the watched {watched(run.cfg)} score fell to {score:.3f} (best {state.best:.3f}, round {state.best_round})"
    if verdict == "stop":
        run.say(
            f"[bold red]recovery[/]: {fell} after {state.rollbacks} rollback(s), the most recovery.max_recoveries "
            f"allows: the run ends on round {state.best_round}'s state"
        )
        return True
    state.rollbacks += 1
    state.lr_scale *= rc.lr_factor
    state.window = []
    run.say(
        f"[bold yellow]recovery[/]: {fell}: rolled back to round {state.best_round}'s state, learning rate x"
        f"{state.lr_scale:g}, on with unseen prompts (rollback {state.rollbacks} of {rc.max_recoveries})"
    )
    return False


def end_on_best(run, accuracy: float) -> int | None:
    """After the last evaluation (`accuracy`): with recovery watching the evaluation, a fall past
    the margin below the best restores the best state, which the run then exports. The round
    whose state was restored (None: the run ends as it is)."""
    state, rc = run.recovery, run.cfg.recovery
    if watched(run.cfg) != "eval" or state.best is None or accuracy >= floor(state.best, rc.margin, rc.relative_margin):
        return None
    restore_best(run.run_dir, run.backend, run.engine)
    run.say(
        f"[bold yellow]recovery[/]: the last evaluation fell to {accuracy:.3f} (best {state.best:.3f}, round "
        f"{state.best_round}): the run ends on round {state.best_round}'s state (final/), evaluated again"
    )
    return state.best_round
