"""A run's sandbox as its users hold it: the settings from the config's `sandbox:` section,
the isolation tier (checked when built: fail closed), a cache of results and running counts.
Used by the code rewards, the tool loop and the code tasks' checks.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from plait import sandbox
from plait.sandbox import ExecResult, Limits


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


def _key(code: str, tests: list[str], setup: str) -> str:
    return hashlib.sha256("\0".join([code, setup, *tests]).encode()).hexdigest()
