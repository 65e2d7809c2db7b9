"""Length shaping."""

from __future__ import annotations


def length_penalty(completions: list[str], completion_ids: list[list[int]], max_tokens: int = 256, **_) -> list[float]:
    """-len/max_tokens per completion: 0 for an empty answer, -1 at max_tokens (linear).

    Mild pressure towards short answers; weight it low next to the accuracy reward.
    """
    return [-min(len(ids), max_tokens) / max_tokens for ids in completion_ids]
