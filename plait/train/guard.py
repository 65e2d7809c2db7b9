"""Stops that keep a run's state safe: non-finite optimizer steps, and preemption signals.

Non-finite steps: a NaN/inf gradient norm means the step would poison the weights and the
AdamW moments for good. The backend then skips the update (weights and optimizer untouched);
the loop counts the skip and does not advance the LR schedule. After `limit` consecutive
skips the run stops with `TrainingDiverged`, without writing a checkpoint, so the last good
one stays the newest. Every process sees the same norm (it is reduced over processes), so
they all skip, and all stop, together.

Engine drift: a round sampled with the weights it is trained from must get the same log-probs
from the engine as from the trainer, up to the rounding of the two precisions' kernels. When the
mean gap over the round's first update (`logprob_gap/before_update`: later updates of the round
see weights that moved) passes `rollout.max_logprob_gap`, the engine does not hold the trainer's
weights (a weight sync that failed silently, corrupted weights, a server another trainer updates)
and the run stops with `EngineDrift` before that round's checkpoint is written.

Preemption: the first SIGTERM or SIGINT (Slurm's time limit, a spot-instance notice, Ctrl-C)
asks the loop to finish the step it is in, write a checkpoint and exit with PREEMPTED_EXIT;
a second one stops at once.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading

from plait.rollout.precision import coarser, rollout_precision


PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later", what a requeueing scheduler should do
DIVERGED_EXIT = 3


class TrainingDiverged(RuntimeError):
    """Too many consecutive optimizer steps with non-finite gradients."""


class EngineDrift(TrainingDiverged):
    """The rollout engine's log-probs left the trainer's: it samples from other weights."""


# rollout.max_logprob_gap=auto. A healthy round stays far below (tiny test model, Intel Xeon with
# AVX-512/AMX: fp32 ~4e-7 for the HF engine and vLLM, bf16 ~1e-4); an engine left one update
# behind at the tests' learning rate (1e-3) shows ~0.1, corrupted weights more. bf16 logits of a
# real model are coarse: SmolLM2-135M trained in bf16 against fp32 rollouts showed up to 0.054 in
# the demo and 0.135 in bench/vs_trl.py (Zen 5), a healthy run, so bf16's limit leaves room above
# that. int8 rollouts sample from a coarser policy still: 0.1-0.85 on SmolLM2-135M
# (bench/rollout_precision.py, the demo), so only gross corruption stands out there.
DRIFT_LIMITS = {"fp32": 1e-2, "bf16": 0.5, "int8": 2.0}


def drift_limit(cfg) -> float | None:
    """The largest mean |engine - trainer| log-prob a synchronous round may show (None: off).
    auto is off where the gap is not rounding alone by construction: vLLM reports log-probs of
    the top-k / top-p truncated distribution, which the trainer does not recompute."""
    r = cfg.rollout
    if r.max_logprob_gap != "auto":
        return r.max_logprob_gap
    if r.engine == "vllm" and (r.top_p < 1.0 or r.top_k > 0):
        return None
    return DRIFT_LIMITS[precisions(cfg)[0]]


def precisions(cfg) -> tuple[str, str]:
    """The coarser of the engine's and the trainer's precision (it sets the healthy gap), and
    how the two are said in messages."""
    engine, trainer = rollout_precision(cfg), cfg.train.precision
    said = trainer if engine == trainer else f"rollouts {engine}, training {trainer}"
    return coarser(engine, trainer), said


def check_drift(cfg, round_: int, gap: float, sampled_version: int) -> None:
    """Raise EngineDrift when round `round_`, sampled with the weights after `sampled_version`
    rounds, shows a mean log-prob gap past the limit. Rounds sampled with older weights by
    design (asynchronous runs) or with several versions (in-flight updates) are not checked:
    their gap is the policy's own change. Nor is a gap that is not finite: the trainer's own
    log-probs are broken then (weights blown up), which the non-finite guard stops."""
    limit = drift_limit(cfg)
    if limit is None or sampled_version != round_ - 1 or cfg.rollout.inflight_updates:
        return
    if math.isfinite(gap) and gap > limit:
        raise EngineDrift(
            f"round {round_}: the rollout engine's log-probs of the sampled tokens differ from the trainer's by "
            f"{gap:.3g} on average (limit {limit:g}: rollout.max_logprob_gap, {precisions(cfg)[1]}). The engine "
            "does not hold the trainer's weights: a weight sync failed or corrupted them, or another trainer "
            "updates the same rollout server. This round was not saved; checkpoints already written are intact: "
            "fix the engine and rerun with resume=auto. (A healthy round stays near 1e-6 in fp32, under ~0.15 in bf16; "
            "rollout.max_logprob_gap=null turns the check off.)"
        )


class Preempted(Exception):
    """A stop signal arrived; the checkpoint of `step` is written."""

    def __init__(self, run_dir, round_: int, signame: str):
        self.run_dir, self.round, self.signame = run_dir, round_, signame
        super().__init__(
            f"{signame}: stopped after round {round_} with a checkpoint; continue with `plait train --resume {run_dir}`"
        )


class NonFiniteGuard:
    """Counts skipped (non-finite) optimizer steps; raises after `limit` in a row."""

    def __init__(self, limit: int):
        self.limit, self.streak, self.skipped = limit, 0, 0

    def check(self, applied: bool, grad_norm: float, round_: int) -> bool:
        """Count one optimizer step the backend applied (or skipped: its gradient norm was not
        finite); returns `applied`."""
        if applied:
            self.streak = 0
            return True
        self.streak += 1
        self.skipped += 1
        if self.streak > self.limit:
            raise TrainingDiverged(
                f"round {round_}: {self.streak} optimizer steps in a row had a non-finite gradient norm ({grad_norm}); "
                f"each was skipped (weights and optimizer untouched) and train.max_nonfinite_steps={self.limit} "
                "allows no more. The newest checkpoint predates them and is intact. "
                "Try a lower train.learning_rate, train.max_grad_norm, "
                "train.precision=fp32, or check the rewards for inf/NaN."
            )
        return False


class StopSignal:
    """SIGTERM/SIGINT -> `requested` (first), KeyboardInterrupt (second). Only the main thread
    can take signals; elsewhere (a Ray actor's worker thread) `install` does nothing."""

    def __init__(self):
        self.requested: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None:
            self.uninstall()
            raise KeyboardInterrupt(f"second {name}")
        self.requested = name
        print(
            f"plait: {name} received: finishing this step, then writing a checkpoint (send it again to stop now)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> "StopSignal":
        # a Ray actor's signals belong to Ray (the launcher stops actors itself)
        if threading.current_thread() is threading.main_thread() and "PLAIT_NODE_ID" not in os.environ:
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
