"""Code-execution rewards: run each completion's code against its row's tests in the sandbox.

Dataset columns (one row per problem; see docs/rewards.md "Code tasks"):
  tests        a list of Python statements, one test each (or one string of statements)
  setup        optional code run after the program and before the tests
  code_prefix  optional code the completion continues (HumanEval's signature + docstring);
               used when the completion does not define `entry_point` itself
  entry_point  optional name of the function under test

The code runs only inside `plait.sandbox` (never in this process), through a
`Sandbox` (plait/sandbox/box.py): a training run builds one from its config's `sandbox:` section and hands it to the
rewards (`sandbox=`); called without one, they use `default_sandbox()` (default settings). An
execution the sandbox could not carry out is None ("not applicable"), not a wrong answer.
"""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor

from plait.sandbox import ExecResult
from plait.sandbox.box import Sandbox, default_sandbox


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, else the whole text."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    if "```" in text:  # an unclosed fence: take what follows it
        return re.sub(r"^[ \t]*(?:python|py|python3)?[ \t]*\n", "", text.split("```", 1)[1])
    return text


def build_program(completion: str, code_prefix: str | None = None, entry_point: str | None = None) -> str:
    """The code to run: the completion's code, after `code_prefix` unless it defines the
    entry point itself (a model often restates the whole function)."""
    code = extract_code(completion)
    if not code_prefix:
        return code
    if entry_point and re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        # keep the prefix's imports (HumanEval prompts import typing names the code uses)
        imports = "\n".join(line for line in code_prefix.splitlines() if line.startswith(("import ", "from ")))
        return imports + "\n" + code if imports else code
    return code_prefix + code


def split_tests(tests) -> list[str]:
    """A list of statements as given, or one string cut into its top-level statements."""
    if tests is None:
        return []
    if isinstance(tests, str):
        try:
            return [ast.get_source_segment(tests, node) for node in ast.parse(tests).body]
        except SyntaxError as err:
            raise ValueError(f"the tests do not parse: {err}") from None
    return [str(t) for t in tests]


def humaneval_tests(test_source: str, entry_point: str) -> tuple[str, list[str]]:
    """HumanEval's `def check(candidate): assert ...` as (setup, one test per assert), so a
    completion can be scored by the fraction of asserts it passes. Statements of `check`
    without an assert (helper variables) run just before the next test."""
    tree = ast.parse(test_source)
    setup, tests, pending = [], [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            for stmt in node.body:
                seg = ast.get_source_segment(test_source, stmt)
                seg = "\n".join(line[stmt.col_offset :] if i else line for i, line in enumerate(seg.splitlines()))
                if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                    tests.append("\n".join(pending + [seg]))
                    pending = []
                else:
                    pending.append(seg)
        else:
            setup.append(ast.get_source_segment(test_source, node))
    setup.append(f"candidate = {entry_point}")
    return "\n".join(setup), tests


def run_all(
    box: Sandbox,
    completions: list[str],
    tests: list,
    setup: list | None = None,
    code_prefix: list | None = None,
    entry_point: list | None = None,
) -> list[ExecResult | None]:
    """Every completion against its row's tests in `box`, `box.settings.workers` sandboxes at a time;
    None for rows without tests."""
    n = len(completions)
    setup, code_prefix, entry_point = (col or [None] * n for col in (setup, code_prefix, entry_point))

    def one(i: int) -> ExecResult | None:
        t = split_tests(tests[i])
        if not t:
            return None
        return box.execute(build_program(completions[i], code_prefix[i], entry_point[i]), t, setup[i] or "")

    with ThreadPoolExecutor(max_workers=max(1, box.settings.workers)) as pool:
        return list(pool.map(one, range(n)))


def code_pass(
    completions: list[str],
    tests: list,
    setup: list | None = None,
    code_prefix: list | None = None,
    entry_point: list | None = None,
    sandbox: Sandbox | None = None,
    **_,
) -> list[float | None]:
    """1.0 if the code passes every test (and the harness ran to the end), else 0.0; None
    where the row has no tests or the sandbox failed (excluded, not scored as wrong)."""
    results = run_all(sandbox or default_sandbox(), completions, tests, setup, code_prefix, entry_point)
    return [None if r is None or not r.valid else float(r.all_passed) for r in results]


def code_tests_passed(
    completions: list[str],
    tests: list,
    setup: list | None = None,
    code_prefix: list | None = None,
    entry_point: list | None = None,
    sandbox: Sandbox | None = None,
    **_,
) -> list[float | None]:
    """The fraction of the row's tests the code passes (a denser signal than pass/fail);
    None as for code_pass."""
    results = run_all(sandbox or default_sandbox(), completions, tests, setup, code_prefix, entry_point)
    return [None if r is None or not r.valid else r.fraction for r in results]


code_pass.needs_sandbox = True
code_tests_passed.needs_sandbox = True
