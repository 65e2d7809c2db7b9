"""Wall-clock time per phase of a step (generate, score, train, ...)."""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    """`with timer("generate"): ...` adds the elapsed seconds to that phase for this step.
    Phases don't nest: each second of a step is in at most one phase, and what no phase
    covers (logging, metrics, waiting for other processes between phases) is `idle`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._step_start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def reset(self) -> dict[str, float]:
        """This step's times (with `step` = the whole step, `idle` = the rest) and start a new step."""
        now = time.perf_counter()
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = now - self._step_start
        out["time/idle"] = max(0.0, out["time/step"] - sum(self.seconds.values()))
        self.seconds, self._step_start = {}, now
        return out
