"""Format rewards: did the completion follow the requested answer layout?"""

from __future__ import annotations

import re

from plait.rewards._checks import require_int
from plait.rewards.math import accuracy, final_box


_THINK = re.compile(r"^\s*<think>.+?</think>\s*<answer>.+?</answer>\s*$", re.DOTALL)


def boxed_format(
    completions: list[str],
    when_solved: bool = False,
    answer: list[str | None] | None = None,
    prompts: list | None = None,
    **_,
) -> list[float]:
    """1.0 if the completion puts a non-empty final answer in \\boxed{...}, else 0.0.

    when_solved: pay it only among the completions of a prompt of which at least one has the
    right final answer (`accuracy`). Where every answer to a prompt is wrong, the format alone
    would tell them apart, and group-scaled advantages make that small difference push as hard
    as a right answer does elsewhere: a policy can settle on boxing wrong answers
    (docs/reproducibility.md). Needs the reference `answer`."""
    boxed = [0.0 if final_box(text) is None else 1.0 for text in completions]
    if not when_solved:
        return boxed
    if answer is None or prompts is None or all(a is None for a in answer):
        raise ValueError(
            "boxed_format with when_solved needs the data's reference answers (the `answer` column, "
            "data.answer_field): use data with answers, or drop when_solved"
        )
    keys = [repr(p) for p in prompts]  # a prompt's completions, wherever they are in the round
    solved = {k for k, right in zip(keys, accuracy(completions, answer)) if right}
    return [b if k in solved else 0.0 for b, k in zip(boxed, keys)]


def think_format(completions: list[str], **_) -> list[float]:
    """1.0 for exactly `<think>...</think><answer>...</answer>` (the Open-R1 / DeepSeek-R1 layout)."""
    return [1.0 if _THINK.match(text) else 0.0 for text in completions]


_TAG_MARKERS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")


def tag_count(completions: list[str], **_) -> list[float]:
    """Partial credit for the `<think>`/`<answer>` layout: 0.25 per marker that appears exactly once.

        r = 0.25 * #{m in ("<think>\\n", "\\n</think>\\n", "\\n<answer>\\n", "\\n</answer>") : count(m) == 1}

    From Open-R1's `tag_count_reward` (Hugging Face, https://github.com/huggingface/open-r1):
    a denser signal than `think_format` early in training, when the full layout is rare.
    A marker that is missing or repeated earns nothing.
    """
    return [sum(0.25 for m in _TAG_MARKERS if text.count(m) == 1) for text in completions]


# One match per step marker: "Step 3:", a numbered line "2. ", a bullet line "- " or "* ",
# or a transition word "First," "Second," "Next," "Finally,".
_STEP = re.compile(
    r"\bStep\s+\d+\s*:"
    r"|^[ \t]*\d+\.(?=\s)"
    r"|^[ \t]*[-*][ \t]"
    r"|\b(?:First|Second|Next|Finally),",
    re.MULTILINE,
)


def reasoning_steps(completions: list[str], expected_steps: int = 3, **_) -> list[float]:
    """Rewards visible step-by-step reasoning, saturating at `expected_steps` markers:

        r = min(1, n / expected_steps)

    n counts every step marker: `Step k:`, a line starting with a number and a dot (`1. `),
    a bullet line (`- ` or `* `), and the transition words `First,` `Second,` `Next,`
    `Finally,` (a line "1. First, ..." counts twice). From Open-R1's `reasoning_steps_reward`
    (Hugging Face, https://github.com/huggingface/open-r1), which uses the same markers and
    expects 3 steps.
    """
    require_int("reasoning_steps", "expected_steps", expected_steps)
    return [min(1.0, len(_STEP.findall(text)) / expected_steps) for text in completions]
