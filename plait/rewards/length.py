"""Length shaping."""

from __future__ import annotations

import math

from plait.rewards._checks import require_int, require_number
from plait.rewards.math import accuracy


def length_penalty(completions: list[str], completion_ids: list[list[int]], max_tokens: int = 256, **_) -> list[float]:
    """-len/max_tokens per completion: 0 for an empty answer, -1 at max_tokens (linear).

    Mild pressure towards short answers; weight it low next to the accuracy reward.
    """
    return [-min(len(ids), max_tokens) / max_tokens for ids in completion_ids]


def soft_overlong_punishment(
    completions: list[str], completion_ids: list[list[int]], max_length: int = 256, cache: int = 64, **_
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), by length L:

        0                          if L <= max_length - cache
        (max_length - cache - L) / cache   inside the last `cache` tokens (0 down to -1)
        -1                         if L > max_length

    Set max_length to rollout.max_completion_length.
    """
    if not 0 < cache <= max_length:
        raise ValueError(
            f"soft_overlong_punishment needs 0 < cache <= max_length, got cache={cache}, max_length={max_length}"
        )
    free = max_length - cache
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= free else -1.0 if n > max_length else (free - n) / cache)
    return out


def cosine_length(
    completions: list[str],
    completion_ids: list[list[int]],
    answer: list[str | None],
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    max_length: int = 256,
    **_,
) -> list[float | None]:
    """Cosine-scaled length reward (Yeo et al. 2025, "Demystifying Long Chain-of-Thought
    Reasoning in LLMs", arXiv:2502.03373; Open-R1's `get_cosine_scaled_reward`).

    Correctness is `plait.rewards.math.accuracy` against the `answer` column; L is the token
    count len(completion_ids[i]), clipped at max_length. With c = cos(pi * min(L, max_length) / max_length):

        correct:  r = min_value_correct + (max_value_correct - min_value_correct) / 2 * (1 + c)
        wrong:    r = max_value_wrong   + (min_value_wrong   - max_value_wrong)   / 2 * (1 + c)

    so a correct answer earns max_value_correct at L=0 falling to min_value_correct at
    max_length (shorter is better), and a wrong one gets min_value_wrong (the harshest) at L=0
    rising to max_value_wrong at max_length (a long attempt beats a short wrong guess).
    Rows without a reference answer get None (not applicable).
    """
    for name, value in (
        ("min_value_wrong", min_value_wrong),
        ("max_value_wrong", max_value_wrong),
        ("min_value_correct", min_value_correct),
        ("max_value_correct", max_value_correct),
    ):
        require_number("cosine_length", name, value)
    require_int("cosine_length", "max_length", max_length)
    if not min_value_wrong <= max_value_wrong:
        raise ValueError(
            f"cosine_length: min_value_wrong must be <= max_value_wrong, got {min_value_wrong} > {max_value_wrong}"
        )
    if not min_value_correct <= max_value_correct:
        raise ValueError(
            "cosine_length: min_value_correct must be <= max_value_correct, "
            f"got {min_value_correct} > {max_value_correct}"
        )
    if not max_value_wrong <= min_value_correct:
        raise ValueError(
            "cosine_length: max_value_wrong must be <= min_value_correct (a wrong answer may not outscore a "
            f"correct one), got {max_value_wrong} > {min_value_correct}"
        )
    correct = accuracy(completions, answer=answer)
    out: list[float | None] = []
    for ok, gold, ids in zip(correct, answer, completion_ids):
        if gold is None:
            out.append(None)
            continue
        c = math.cos(math.pi * min(len(ids), max_length) / max_length)
        start, end = (max_value_correct, min_value_correct) if ok else (min_value_wrong, max_value_wrong)
        out.append(end + (start - end) / 2 * (1 + c))
    return out
