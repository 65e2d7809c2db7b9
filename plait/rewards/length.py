"""Length shaping."""

from __future__ import annotations


def length_penalty(completions: list[str], completion_ids: list[list[int]], max_tokens: int = 256, **_) -> list[float]:
    """-len/max_tokens per completion: 0 for an empty answer, -1 at max_tokens (linear).

    Mild pressure towards short answers; weight it low next to the accuracy reward.
    """
    return [-min(len(ids), max_tokens) / max_tokens for ids in completion_ids]


def soft_overlong_punishment(completions: list[str], completion_ids: list[list[int]], max_length: int = 256, cache: int = 64, **_) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), by length L:

        0                          if L <= max_length - cache
        (max_length - cache - L) / cache   inside the last `cache` tokens (0 down to -1)
        -1                         if L > max_length

    Set max_length to rollout.max_completion_length.
    """
    if not 0 < cache <= max_length:
        raise ValueError(f"soft_overlong_punishment needs 0 < cache <= max_length, got cache={cache}, max_length={max_length}")
    free = max_length - cache
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= free else -1.0 if n > max_length else (free - n) / cache)
    return out
