"""Format rewards: did the completion follow the requested answer layout?"""

from __future__ import annotations

import re

from plait.rewards.math import last_boxed

_THINK = re.compile(r"^\s*<think>.+?</think>\s*<answer>.+?</answer>\s*$", re.DOTALL)


def boxed_format(completions: list[str], **_) -> list[float]:
    """1.0 if the completion puts a non-empty final answer in \\boxed{...}, else 0.0."""
    return [1.0 if (inner := last_boxed(text)) is not None and inner.strip() else 0.0 for text in completions]


def think_format(completions: list[str], **_) -> list[float]:
    """1.0 for exactly `<think>...</think><answer>...</answer>` (the Open-R1 / DeepSeek-R1 layout)."""
    return [1.0 if _THINK.match(text) else 0.0 for text in completions]
