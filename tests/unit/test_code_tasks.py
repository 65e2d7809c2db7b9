"""Code-task plumbing that runs no code: extraction, program assembly, test splitting, and
HumanEval's check() cut into one test per assert."""

import pytest

from plait.data.tasks import humaneval, humaneval_capacity
from plait.rewards.code import build_program, extract_code, humaneval_tests, split_tests
from plait.train.sampling import keep_for_second_stage


def test_extract_code_takes_the_last_fenced_block():
    text = "first\n```python\nx = 1\n```\nthen\n```py\ndef f():\n    return 2\n```\nbye"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("no fences, just code = 1") == "no fences, just code = 1"
    assert extract_code("```python\nz = 4\n") == "z = 4\n"  # cut off before the closing fence


def test_build_program_continues_the_prefix_unless_the_function_is_restated():
    prefix = 'from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    """Add."""\n'
    assert build_program("    return a + b\n", prefix, "add") == prefix + "    return a + b\n"
    full = "```python\ndef add(a, b):\n    return a + b\n```"
    assert build_program(full, prefix, "add") == "from typing import List\ndef add(a, b):\n    return a + b\n"
    assert build_program(full) == "def add(a, b):\n    return a + b\n"


def test_split_tests():
    assert split_tests(["assert f(1) == 2", "assert f(2) == 3"]) == ["assert f(1) == 2", "assert f(2) == 3"]
    assert split_tests("x = 1\nassert x == 1\nfor i in range(2):\n    assert i < 2\n") == [
        "x = 1",
        "assert x == 1",
        "for i in range(2):\n    assert i < 2",
    ]
    assert split_tests(None) == []
    with pytest.raises(ValueError, match="do not parse"):
        split_tests("assert (")


def test_humaneval_check_becomes_one_test_per_assert():
    src = (
        "METADATA = {}\n\n\ndef check(candidate):\n    data = [1, 2]\n    assert candidate(data) == 3\n"
        "    for x in data:\n        assert candidate([x]) == x\n    assert True\n"
    )
    setup, tests = humaneval_tests(src, "total")
    assert setup == "METADATA = {}\ncandidate = total"
    assert tests == [
        "data = [1, 2]\nassert candidate(data) == 3",
        "for x in data:\n    assert candidate([x]) == x",
        "assert True",
    ]


def test_humaneval_task_rows_and_split():
    train_n, eval_n = humaneval_capacity("train"), humaneval_capacity("eval")
    assert train_n + eval_n == 164 and 20 < eval_n < 45
    rows = humaneval("eval", eval_n)
    ids = {r["task_id"] for r in rows}
    assert not ids & {r["task_id"] for r in humaneval("train", train_n)}
    row = rows[0]
    assert row["tests"] and row["entry_point"] in row["code_prefix"] and "```python" in row["prompt"]
    with pytest.raises(ValueError, match="the split has"):
        humaneval("eval", eval_n + 1)


@pytest.mark.parametrize(
    "scores, rule, keep",
    [
        ([1.0, 1.0], "not_all_correct", False),
        ([1.0, 0.0], "not_all_correct", True),
        ([0.0, 0.0], "not_all_correct", True),
        ([0.0, 0.0], "not_all_failed", False),
        ([0.5, 1.0], "not_all_failed", True),
        ([1.0, 0.0], "mixed", True),
        ([1.0, 1.0], "mixed", False),
        ([0.0, None], "mixed", False),
        ([1.0, None], "mixed", True),
    ],
)
def test_two_stage_rules(scores, rule, keep):
    assert keep_for_second_stage(scores, rule, threshold=1.0) is keep
