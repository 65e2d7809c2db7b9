"""Code-execution rewards: run each completion's code against its row's tests in the sandbox.

Dataset columns (one row per problem; see docs/rewards.md "Code tasks"):
  tests        a list of Python statements, one test each (or one string of statements)
  setup        optional code run after the program and before the tests
  code_prefix  optional code the completion continues (HumanEval's signature + docstring);
               used when the completion does not define `entry_point` itself
  entry_point  optional name of the function under test

The code runs only inside `plait.rewards.sandbox` (never in this process), through a
`Sandbox`: a training run builds one from its config's `sandbox:` section and hands it to the
rewards (`sandbox=`); called without one, they use `default_sandbox()` (default settings). An
execution the sandbox could not carry out is None ("not applicable"), not a wrong answer.
"""

from __future__ import annotations

import ast
import hashlib
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from plait.rewards import sandbox
from plait.rewards.sandbox import ExecResult, Limits


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass
class SandboxSettings:
    limits: Limits = field(default_factory=Limits)
    min_tier: str = "namespaces"
    workers: int = 2
    python: str | None = None


def sandbox_settings(cfg) -> SandboxSettings:
    """Config `sandbox:` section -> settings."""
    limits = Limits(
        timeout_s=cfg.timeout_s,
        cpu_s=cfg.cpu_s,
        memory_mb=cfg.memory_mb,
        max_processes=cfg.max_processes,
        output_bytes=cfg.output_bytes,
    )
    return SandboxSettings(limits, cfg.min_tier, cfg.workers, cfg.python)


def uses_sandbox(cfg) -> bool:
    """Does a configured reward, or the eval metric, execute code?"""
    from plait.rewards import resolve_reward

    names = [r.name for r in cfg.rewards] + [cfg.eval.metric]
    return any(getattr(resolve_reward(name), "needs_sandbox", False) for name in names)


class Sandbox:
    """Where a run's code rewards execute: its settings, the isolation tier, a cache of results
    (identical program and tests run once) and running counts of the work done.

    Building one checks the tier: below `settings.min_tier` it raises sandbox.SandboxUnavailable,
    so nothing runs before the minimum is confirmed (fail closed). Thread-safe: the rewards of a
    step, and the executions of one reward, run on several threads."""

    CACHE_SIZE = 4096

    def __init__(self, settings: SandboxSettings | None = None):
        self.settings = settings or SandboxSettings()
        self.tier: str = sandbox.require(self.settings.min_tier)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, ExecResult] = OrderedDict()
        self._counts = {"executions": 0, "seconds": 0.0, "invalid": 0, "cached": 0}

    @classmethod
    def from_config(cls, cfg) -> Sandbox:
        """From the config's `sandbox:` section."""
        return cls(sandbox_settings(cfg))

    def counts(self) -> dict[str, float]:
        """Totals so far: executions, their seconds (the whole cost: supervisor, namespaces,
        program), invalid runs (the sandbox failed) and cached results reused. The counts of one
        call are the difference of two snapshots."""
        with self._lock:
            return dict(self._counts)

    def execute(self, code: str, tests: list[str], setup: str = "") -> ExecResult:
        """One sandboxed run, with identical (program, tests) reused from a small cache."""
        key = _key(code, tests, setup)
        with self._lock:
            if key in self._cache:
                self._counts["cached"] += 1
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.monotonic()
        res = sandbox.run_tests(code, tests, setup, self.settings.limits, tier=self.tier, python=self.settings.python)
        with self._lock:
            self._counts["executions"] += 1
            self._counts["seconds"] += time.monotonic() - started
            if not res.valid:
                self._counts["invalid"] += 1
            else:  # never cache an infrastructure failure
                self._cache[key] = res
                if len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
        return res

    def run_all(
        self,
        completions: list[str],
        tests: list,
        setup: list | None = None,
        code_prefix: list | None = None,
        entry_point: list | None = None,
    ) -> list[ExecResult | None]:
        """Every completion against its row's tests, `settings.workers` sandboxes at a time;
        None for rows without tests."""
        n = len(completions)
        setup, code_prefix, entry_point = (col or [None] * n for col in (setup, code_prefix, entry_point))

        def one(i: int) -> ExecResult | None:
            t = split_tests(tests[i])
            if not t:
                return None
            return self.execute(build_program(completions[i], code_prefix[i], entry_point[i]), t, setup[i] or "")

        with ThreadPoolExecutor(max_workers=max(1, self.settings.workers)) as pool:
            return list(pool.map(one, range(n)))


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The sandbox code rewards use when called without one (a user calling code_pass
    directly): default settings, built (and its tier checked) on first use. A training run
    passes its own, built from the config's `sandbox:` section."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT


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


def _key(code: str, tests: list[str], setup: str) -> str:
    return hashlib.sha256("\0".join([code, setup, *tests]).encode()).hexdigest()


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
    results = (sandbox or default_sandbox()).run_all(completions, tests, setup, code_prefix, entry_point)
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
    results = (sandbox or default_sandbox()).run_all(completions, tests, setup, code_prefix, entry_point)
    return [None if r is None or not r.valid else r.fraction for r in results]


code_pass.needs_sandbox = True
code_tests_passed.needs_sandbox = True
