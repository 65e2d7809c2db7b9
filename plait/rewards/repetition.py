"""Repetition shaping: penalise completions that loop over the same phrases."""

from __future__ import annotations

import math


def repetition_penalty(completions: list[str], ngram_size: int = 3, max_penalty: float = -1.0, **_) -> list[float]:
    """N-gram repetition penalty (Yeo et al. 2025, arXiv:2502.03373, sec. 4; Open-R1's
    `get_repetition_penalty_reward`). Over the lowercased whitespace-split words of a completion:

        r = (1 - unique_ngrams / total_ngrams) * max_penalty

    0 when no n-gram repeats, approaching max_penalty as the text becomes one phrase over and
    over. Texts with fewer than `ngram_size` words get 0. ngram_size >= 1, max_penalty <= 0.
    """
    if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
        raise ValueError(f"repetition_penalty: ngram_size must be an integer >= 1, got {ngram_size!r}")
    if isinstance(max_penalty, bool) or not isinstance(max_penalty, (int, float)) or not math.isfinite(max_penalty) or max_penalty > 0:
        raise ValueError(f"repetition_penalty: max_penalty must be a finite number <= 0, got {max_penalty!r}")
    out = []
    for text in completions:
        words = text.lower().split()
        total = len(words) - ngram_size + 1
        if total < 1:
            out.append(0.0)
            continue
        unique = len({tuple(words[i : i + ngram_size]) for i in range(total)})
        out.append((1 - unique / total) * max_penalty + 0.0)  # + 0.0 turns -0.0 into 0.0
    return out
