"""Repetition shaping: penalise completions that loop over the same phrases."""

from __future__ import annotations

from plait.rewards._checks import require_int, require_number


def repetition_penalty(completions: list[str], ngram_size: int = 3, max_penalty: float = -1.0, **_) -> list[float]:
    """N-gram repetition penalty (Yeo et al. 2025, arXiv:2502.03373, sec. 4; Open-R1's
    `get_repetition_penalty_reward`). Over the lowercased whitespace-split words of a completion:

        r = (1 - unique_ngrams / total_ngrams) * max_penalty

    0 when no n-gram repeats, approaching max_penalty as the text becomes one phrase over and
    over. Texts with fewer than `ngram_size` words get 0. ngram_size >= 1, max_penalty <= 0.
    """
    require_int("repetition_penalty", "ngram_size", ngram_size)
    require_number("repetition_penalty", "max_penalty", max_penalty, at_most=0)
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
