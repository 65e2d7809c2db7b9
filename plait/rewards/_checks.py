"""Argument checks shared by the reward functions: one message shape for every reward."""

from __future__ import annotations

import math


def require_int(reward: str, name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{reward}: {name} must be an integer >= {low}, got {value!r}")


def require_number(reward: str, name: str, value, at_most: float | None = None) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (at_most is not None and value > at_most):
        bound = "" if at_most is None else f" <= {at_most:g}"
        raise ValueError(f"{reward}: {name} must be a finite number{bound}, got {value!r}")
