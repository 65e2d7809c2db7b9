"""Hostile programs against the code sandbox: each must be contained, leave nothing running,
leave the host unchanged, and never leak the trainer's secret.

Every program sets ESCAPED = True if its attack worked, and its one test is `assert ESCAPED`:
a passing test means containment failed. Programs run in every tier this machine provides;
what the weakest tier (`process`, no namespaces) cannot contain is listed in NEEDS_NAMESPACES
(and documented in docs/sandbox.md).
"""

import os
import secrets
import shutil
import socket
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from plait.rewards import sandbox
from plait.rewards.sandbox import Limits, run_tests


REPO = Path(__file__).resolve().parents[2]
SECRET = "plait-sentinel-" + secrets.token_hex(8)
MARK = "plait_escape_" + secrets.token_hex(4)
FAST = Limits(timeout_s=4, cpu_s=4, memory_mb=512, max_processes=32)

# Where a program must never be able to write (checked after every program).
OUTSIDE = [
    Path("/root") / MARK,
    Path("/etc") / MARK,
    REPO / MARK,
    Path("/dev/shm") / MARK,
    Path("/tmp") / MARK,
    Path("/var/tmp") / MARK,
]


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    return srv


PROGRAMS = {
    "fork_bomb": """
        import os
        ESCAPED = False
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
    "fork_bomb_ctypes": """
        import ctypes
        libc = ctypes.CDLL(None)
        ESCAPED = False
        while True:
            libc.fork()
    """,
    "fork_bomb_subprocess": """
        import subprocess, sys
        ESCAPED = False
        code = (
            "import subprocess, sys\\nwhile True:\\n    subprocess.Popen([sys.executable, '-c', "
            "open(__file__).read() if False else 'import time; time.sleep(60)'])"
        )
        procs = []
        while True:
            try:
                procs.append(subprocess.Popen([sys.executable, "-c", code]))
            except OSError:
                pass
    """,
    "thread_bomb": """
        import threading, time
        n = 0
        while True:
            try:
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
                n += 1
            except RuntimeError:
                break
        ESCAPED = n > 100
    """,
    "memory_bomb": """
        blob = bytearray(8 << 30)  # 8 GiB
        ESCAPED = True
    """,
    "memory_bomb_many_processes": """
        import os, time
        for _ in range(12):
            if os.fork() == 0:
                try:
                    blob = bytearray(400 << 20)  # each child touches 400 MB
                    for i in range(0, len(blob), 4096):
                        blob[i] = 1
                except MemoryError:
                    pass
                time.sleep(60)
                os._exit(0)
        time.sleep(60)
        ESCAPED = True
    """,
    "cpu_loop": """
        while True:
            pass
        ESCAPED = True
    """,
    "long_sleep": """
        import time
        time.sleep(3600)
        ESCAPED = True
    """,
    "ignores_sigterm": """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            time.sleep(0.1)
    """,
    "double_fork_daemon": """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(8)  # outlive the timeout, then try to leave a mark
                for p in ("/tmp/MARK", "/dev/shm/MARK"):
                    try:
                        open(p, "w").write("daemon")
                    except OSError:
                        pass
                os._exit(0)
            os._exit(0)
        ESCAPED = False
    """,
    "writes_outside": """
        import os
        ESCAPED = False
        marks = ("/root/MARK", "/etc/MARK", "REPO/MARK", "/dev/shm/MARK", "/tmp/MARK", "/var/tmp/MARK", "../MARK")
        for p in (*marks, "../../MARK", os.path.expanduser("~/MARK")):
            try:
                with open(p, "w") as f:
                    f.write("escaped")
            except OSError:
                continue
    """,
    "fills_the_disk": """
        import os
        ESCAPED = False
        written = 0
        try:
            for i in range(10_000):
                with open(f"fill_{i}", "wb") as f:
                    for _ in range(8):
                        f.write(b"x" * (1 << 20))
                        written += 1 << 20
        except OSError:
            pass
        ESCAPED = written > (512 << 20)
    """,
    "outbound_network": """
        import socket
        ESCAPED = False
        for host, port in (("1.1.1.1", 53), ("8.8.8.8", 443), ("127.0.0.1", 22)):
            try:
                socket.create_connection((host, port), timeout=1).close()
                ESCAPED = True
            except OSError:
                pass
        try:
            socket.getaddrinfo("pypi.org", 443)
            ESCAPED = True
        except OSError:
            pass
    """,
    "connects_to_the_trainer": """
        import socket
        ESCAPED = False
        try:
            s = socket.create_connection(("127.0.0.1", PORT), timeout=1)
            s.sendall(b"hello trainer")
            ESCAPED = True
        except OSError:
            pass
    """,
    "reads_secrets": """
        import os, glob
        found = []
        found += [f"{k}={v}" for k, v in os.environ.items()]
        environs = [f"/proc/{os.getppid()}/environ", "/proc/TRAINER/environ", "/proc/1/environ"]
        for path in environs + glob.glob("/proc/*/environ"):
            try:
                found.append(open(path, "rb").read().decode("utf-8", "replace"))
            except OSError:
                pass
        text = "\\n".join(found)
        print(text)
        ESCAPED = "SECRET" in text
    """,
    "kills_its_parents": """
        import os, signal
        ESCAPED = False
        for pid in (os.getppid(), 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.kill(TRAINER, 0)  # may it signal the trainer at all?
            ESCAPED = True
        except OSError:
            pass
        os.kill(-1, signal.SIGKILL)
    """,
    "floods_stdout": """
        import sys
        chunk = "x" * (1 << 20)
        for _ in range(1024):  # 1 GiB
            sys.stdout.write(chunk)
        ESCAPED = True
    """,
    "exhausts_fds": """
        import os, socket
        fds = []
        try:
            while True:
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        ESCAPED = len(fds) > 1000
    """,
    "exits_before_the_asserts": """
        import sys
        sys.exit(0)
    """,
    "hard_exit_before_the_asserts": """
        import os
        os._exit(0)
    """,
    "prints_passed": """
        import os, json
        print("PASSED")
        print("all tests passed")
        fake = [json.dumps({"event": "test", "i": 0, "ok": True}), json.dumps({"event": "done"})]
        for fd in range(3, 32):
            for rec in fake:
                try:
                    os.write(fd, (rec + "\\n").encode())
                except OSError:
                    pass
        ESCAPED = False
    """,
}

# The process tier (no namespaces) can't stop these: world-writable dirs and the network
# are shared with the host. This is why the default minimum tier is 'namespaces'.
NEEDS_NAMESPACES = {"writes_outside", "outbound_network", "connects_to_the_trainer", "double_fork_daemon"}


def _available_tiers():
    return [t for t, why in sandbox.probe().items() if why is None]


def _sandbox_processes():
    """Processes a sandbox may have left: uids the supervisor hands out, or our marker."""
    out = []
    for p in psutil.process_iter(["uids", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE and p.ppid() == 1:
                continue  # reaped by nobody on some containers' init; dead either way
            if p.info["uids"].real >= 1_000_000 or MARK in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.Error, TypeError, AttributeError):
            pass
    return out


@pytest.fixture(scope="module", autouse=True)
def secret_in_trainer_env():
    os.environ["PLAIT_TEST_SECRET"] = SECRET
    yield
    os.environ.pop("PLAIT_TEST_SECRET", None)


@pytest.fixture
def host():
    """Snapshot of what a program could change; checked after it ran."""
    for p in OUTSIDE:
        assert not p.exists()
    before = {"tmp_dirs": set(Path("/tmp").glob("plait-sbx-*")), "disk_free": shutil.disk_usage("/tmp").free}
    yield before
    for p in OUTSIDE + [REPO.parent / MARK]:
        assert not p.exists(), f"the program wrote {p}"
        p.unlink(missing_ok=True)


def _program(name: str, port: int) -> str:
    src = textwrap.dedent(PROGRAMS[name])
    for key, value in (
        ("MARK", MARK),
        ("REPO", str(REPO)),
        ("PORT", str(port)),
        ("TRAINER", str(os.getpid())),
        ("SECRET", SECRET),
    ):
        src = src.replace(key, value)
    return src


@pytest.mark.parametrize("tier", ["process", "namespaces", "seccomp"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_hostile_program_is_contained(name, tier, host):
    if tier not in _available_tiers():
        pytest.skip(f"tier {tier} unavailable here: {sandbox.probe()[tier]}")
    if tier == "process" and name in NEEDS_NAMESPACES:
        pytest.skip("the process tier shares the host's network and world-writable dirs (documented)")
    srv = _listener()
    try:
        res = run_tests(_program(name, srv.getsockname()[1]), ["assert ESCAPED"], limits=FAST, tier=tier)
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody reached the trainer's port
    finally:
        srv.close()
    assert res.valid, res.error
    assert not res.all_passed and res.passed == [], f"{name}: the attack worked ({res})"
    assert SECRET not in res.stdout + res.stderr + "".join(res.errors)
    assert len(res.stdout) <= FAST.output_bytes and len(res.stderr) <= FAST.output_bytes
    assert res.wall_s < FAST.timeout_s + 2
    assert _sandbox_processes() == [], "processes outlived the sandbox"
    assert set(Path("/tmp").glob("plait-sbx-*")) <= host["tmp_dirs"], "temp dir left behind"
    assert host["disk_free"] - shutil.disk_usage("/tmp").free < 200 << 20


def test_daemon_does_not_outlive_the_run():
    """The double-fork daemon sleeps past the timeout and then writes a mark: wait for that."""
    tier = sandbox.active_tier()
    res = run_tests(_program("double_fork_daemon", 0), ["assert True"], limits=FAST, tier=tier)
    assert res.valid and res.all_passed
    time.sleep(9)
    assert _sandbox_processes() == []
    assert not (Path("/tmp") / MARK).exists() and not (Path("/dev/shm") / MARK).exists()


def test_outcomes_are_reported_by_cause():
    tier = sandbox.active_tier()
    assert run_tests("import time\ntime.sleep(30)", [], limits=FAST, tier=tier).status == "timeout"
    assert run_tests(_program("floods_stdout", 0), [], limits=FAST, tier=tier).status == "output_limit"
    mem = run_tests(_program("memory_bomb_many_processes", 0), [], limits=FAST, tier=tier)
    assert mem.status == "memory_limit", mem
    ok = run_tests(
        "def f(x):\n    return 2 * x\nprint('hi')",
        ["assert f(2) == 4", "assert f(3) == 5", "assert f(0) == 0"],
        tier=tier,
    )
    assert ok.status == "exited" and ok.finished and ok.passed == [0, 2] and ok.total == 3
    assert ok.fraction == pytest.approx(2 / 3) and not ok.all_passed and ok.stdout == "hi\n"
    assert "AssertionError" in ok.errors[0]


def test_the_program_runs_unprivileged_and_isolated():
    tier = sandbox.active_tier()
    probe = """
import os, socket
UID = os.getuid()
ENV = dict(os.environ)
HOST = socket.gethostname()
"""
    tests = ["assert UID != 0", "assert 'PLAIT_TEST_SECRET' not in ENV", "assert os.getcwd() != '/'"]
    if tier != "process":
        tests += ["assert HOST == 'sandbox'", "assert os.getpid() < 10", "assert not os.path.exists('/root/.cache')"]
    res = run_tests(probe, tests, tier=tier)
    assert res.all_passed, res


def test_infrastructure_failure_is_invalid_not_wrong():
    res = run_tests("x = 1", ["assert x == 1"], python="/nonexistent/python3")
    assert not res.valid and res.status == "error" and "not found" in res.error
    broken = run_tests("x = 1", ["assert x == 1"], python="/bin/false")
    assert not broken.valid, broken


def test_refuses_below_the_minimum_tier(monkeypatch, capsys):
    from plait.cli import main

    assert sandbox.require("process") in sandbox.TIERS
    config = str(REPO / "configs" / "humaneval.yaml")
    assert main(["check", config]) == 0 and "sandbox: code rewards will run under" in capsys.readouterr().out
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    sandbox.probe(refresh=True)
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap") as err:
            sandbox.require("namespaces")
        assert "min_tier" in str(err.value)
        assert sandbox.active_tier() == "process"
        assert main(["check", config]) == 2  # refuses, before any model loads
        assert "Refusing to run model-written code" in capsys.readouterr().err
        assert main(["check", config, "--set", "sandbox.min_tier=process"]) == 0
    finally:
        monkeypatch.undo()
        sandbox.probe(refresh=True)
