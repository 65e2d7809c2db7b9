"""Math answer checking with `math-verify` (parses LaTeX and plain expressions)."""

from __future__ import annotations

import logging
import re
import threading


class _NoTimeoutNotice(logging.Filter):
    """math-verify warns on every call made without its signal-based time limit; plait runs
    rewards in worker threads, where that limit can't work, and bounds their time itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


# a plain number: "81", "-3.5", "1,000"
_NUMBER = re.compile(r"^-?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?$")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _equal(gold: str | None, text: str) -> float:
    """1.0 if `text` states an answer equal to `gold`, else 0.0.

    math-verify enforces its time limits with signal.alarm, which only works in the main
    thread; elsewhere we switch them off (the caller must bound the time itself).
    """
    if gold is None or not text.strip():
        return 0.0
    from math_verify import parse, verify  # here, not at the top: sympy's import is ~0.4 s of every start

    gold = str(gold)  # a JSON file's number (19) is the answer "19"
    timeouts = {} if _in_main_thread() else {"parsing_timeout": None}
    try:
        # a bare gold answer ("81", "\\frac12") parses reliably once boxed
        target = parse(gold if "$" in gold or "\\boxed" in gold else f"\\boxed{{{gold}}}", **timeouts)
        guess = parse(text, **timeouts)
        if not guess or not target:
            return 0.0
        # When the reference is a number, the answer must be one too: math-verify would
        # evaluate "\\boxed{4 + 9}" to 13, and a policy learns to copy the question into the box.
        if _NUMBER.match(gold.strip()) and not _NUMBER.match(str(guess[-1]).replace(" ", "")):
            return 0.0
        return 1.0 if verify(target, guess, **({} if _in_main_thread() else {"timeout_seconds": None})) else 0.0
    except Exception:  # math-verify raises on pathological LaTeX: that answer is simply wrong
        return 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def final_box(text: str) -> str | None:
    """The content of the last \\boxed{...} when it holds something: the completion's boxed
    final answer (an empty box is none)."""
    inner = last_boxed(text)
    return inner if inner is not None and inner.strip() else None


def accuracy(
    completions: list[str],
    answer: list[str | None],
    read: str = "completion",
    transcript: list[str] | None = None,
    **_,
) -> list[float]:
    """1.0 where the completion's final answer (its last \\boxed{}, else its last expression)
    equals the reference answer mathematically (math-verify), else 0.0. When the reference is
    a plain number the answer must be a number, not an expression that evaluates to it. The
    last box, as boxed_accuracy reads it (math-verify alone would take the first): a completion
    that boxes several candidates is judged by the one it ends on.

    read: "completion" (the model's own words) or "transcript": a multi-turn completion's whole
    text, tool outputs and an agent's turns included, so that the last number a tool printed
    counts (configs/tools-multiply.yaml's half credit for code that computed the answer)."""
    if read not in ("completion", "transcript"):
        raise ValueError(f"accuracy: read must be 'completion' or 'transcript', got {read!r}")
    if read == "transcript" and transcript is not None:  # (single-turn runs pass none: the same text)
        completions = transcript
    boxes = [final_box(text) for text in completions]
    return [
        _equal(gold, text if box is None else f"$\\boxed{{{box}}}$")
        for text, box, gold in zip(completions, boxes, answer)
    ]


def boxed_accuracy(completions: list[str], answer: list[str | None], **_) -> list[float]:
    """1.0 only where the last \\boxed{...} holds a correct answer: the strict metric."""
    boxes = [final_box(text) for text in completions]
    return [0.0 if box is None else _equal(gold, f"$\\boxed{{{box}}}$") for box, gold in zip(boxes, answer)]
