"""Hostile programs against the code sandbox: each must be contained, leave nothing running,
leave the host unchanged, and never leak the trainer's secret.

Every program in PROGRAMS sets ESCAPED = True if its attack worked, and its one test is
`assert ESCAPED`: a passing test means containment failed. Programs run in every tier this
machine provides. What the weakest tier (`process`, no namespaces) cannot contain is listed in
NEEDS_NAMESPACES (skipped there), and writes_outside leaves out the world-writable dirs there;
what it contains only as root (where each run gets a uid of its own instead of the runner's) is
in NEEDS_ROOT_IN_PROCESS_TIER. All of it is documented in docs/sandbox.md.

SECCOMP_REFUSES lists calls that only the seccomp tier's deny-list stops: refused there, and
shown to get through (or fail differently) in the namespaces tier, the same sandbox without it.

Nothing here waits a fixed time for something to happen: it polls the condition, with a
deadline generous enough for a busy 2-core machine, and a contained run passes at once.
"""

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import platform
import secrets
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from plait import sandbox
from plait.sandbox import Limits, run_tests


REPO = Path(__file__).resolve().parents[2]
SECRET = "plait-sentinel-" + secrets.token_hex(8)
MARK = "plait_escape_" + secrets.token_hex(4)
IS_ROOT = os.geteuid() == 0
FAST = Limits(timeout_s=4, cpu_s=4, memory_mb=512, max_processes=32)
# For programs that end by themselves in well under a second: a timeout that only a stalled
# machine reaches, so that their verdict is the attack's outcome and not a timeout.
ROOMY = dataclasses.replace(FAST, timeout_s=60, cpu_s=60)
# For programs only the clock (or RLIMIT_CPU) stops, whatever it is: their verdict is the same at
# any limit, and every test waits the whole limit out.
CLOCKED = dataclasses.replace(FAST, timeout_s=2, cpu_s=2)
# How long a process the sandbox SIGKILLed may take to vanish on a loaded machine. Every
# program's processes run for at least 60 s unless killed, so this wait can't hide a survivor.
GRACE_S = 30.0

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
        # Each child starts sleepers without end. MARK on their command lines lets the test find
        # them whatever their uid.
        sleeper = "import time; time.sleep(60)  # MARK"
        spawner = "\\n".join([
            "import subprocess, sys  # MARK",
            "while True:",
            "    try:",
            f"        subprocess.Popen([sys.executable, '-c', {sleeper!r}])",
            "    except OSError:",
            "        pass",
        ])
        while True:
            try:
                subprocess.Popen([sys.executable, "-c", spawner])
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
                    # bytearray() zero-fills, and this writes every page again: resident
                    # memory, whatever the page size or transparent huge pages do
                    blob = bytearray(400 << 20)  # 400 MB each
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
        import os, sys
        # The daemon leaves the program's session and process group, says it is up over a
        # pipe, waits until the run is over, writes a mark on the host, and stays. It execs so
        # that its command line carries MARK: the test finds it by that, whatever its uid.
        daemon = "\\n".join([
            "import os, sys, time  # MARK",
            "os.write(int(sys.argv[1]), b'up')",
            "time.sleep(5)",
            "for p in ('/tmp/MARK', '/dev/shm/MARK'):",
            "    try:",
            "        open(p, 'w').write('daemon')",
            "    except OSError:",
            "        pass",
            "time.sleep(3600)",
        ])
        r, w = os.pipe()
        os.set_inheritable(w, True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", daemon, str(w)])
            os._exit(0)
        os.close(w)
        os.wait()
        UP = os.read(r, 2) == b"up"  # b"" if the daemon died first
        ESCAPED = False
    """,
    "writes_outside": """
        import os
        ESCAPED = False
        marks = ["/root/MARK", "/etc/MARK", "REPO/MARK", "../MARK", os.path.expanduser("~/MARK")]
        if WORLD_WRITABLE:  # False in the process tier, which shares these with the host (documented)
            marks += ["/dev/shm/MARK", "/tmp/MARK", "/var/tmp/MARK", "../../MARK"]
        for p in marks:
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
        import glob, os
        # HELPER_PID stands in for the trainer: a process started with the secret in its
        # environment, which is what /proc/<pid>/environ shows. The program is not told the
        # secret; it looks for the variable's name, and prints what it finds.
        texts = [f"{k}={v}" for k, v in os.environ.items()]
        paths = ["/proc/HELPER_PID/environ", "/proc/TRAINER/environ", f"/proc/{os.getppid()}/environ"]
        for path in paths + ["/proc/1/environ"] + sorted(glob.glob("/proc/*/environ")):
            try:
                with open(path, "rb") as f:
                    texts.append(f.read().decode("utf-8", "replace"))
            except OSError:
                pass
        found = sorted({e for t in texts for e in t.split("\\0") if e.startswith("PLAIT_TEST_SECRET=")})
        print("\\n".join(found))
        ESCAPED = bool(found)
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

# The process tier (no namespaces) can't stop these: the network is shared with the host. Nor
# writes to the world-writable dirs (/tmp, /dev/shm, /var/tmp; and ../../, which is /tmp there),
# also shared: writes_outside leaves those out in that tier and tries the rest (as root only,
# below). This is why the default minimum tier is 'namespaces'.
NEEDS_NAMESPACES = {"outbound_network", "connects_to_the_trainer"}

# The process tier contains these only as root, where each run gets a uid of its own. Run by
# anyone else, the program has the runner's uid: it may signal, read and outlive the runner's
# own processes (pytest, CI). Skipped there, all but reads_secrets, which only reads: it runs,
# and its leak is an expected failure.
NEEDS_ROOT_IN_PROCESS_TIER = {
    "kills_its_parents": "tier 'process' not as root: the program has the runner's uid, so kill(-1) would kill "
    "the runner's own processes (pytest, CI); contained only as root (a uid per run)",
    "reads_secrets": "tier 'process' not as root: the program has the runner's uid, so it reads "
    "/proc/<pid>/environ of every process of the runner; contained only as root (a uid per run)",
    "double_fork_daemon": "tier 'process' not as root: a daemon that leaves the process group is reached by the "
    "uid sweep only, which needs a uid per run, so root; contained only as root",
    "writes_outside": "tier 'process' not as root: the program has the runner's uid, so it may write wherever the "
    "runner may (the repo included); refused only as root (a uid per run)",
}

# Programs that end by themselves: they must run to their end (the harness's "done"), so that
# "contained" is the attack's measured outcome, not a timeout that cut it short.
RUN_TO_THE_END = {
    "thread_bomb",
    "double_fork_daemon",
    "writes_outside",
    "outbound_network",
    "connects_to_the_trainer",
    "reads_secrets",
    "exhausts_fds",
    "prints_passed",
}

# What stops each runaway program: the cause is asserted, not the wall time (which a loaded
# machine stretches). A limit that kills it means its tests never ran.
STOPPED_BY = {
    "long_sleep": {"timeout"},
    "ignores_sigterm": {"timeout"},
    # the wall clock, or RLIMIT_CPU (SIGXCPU) when it gets a whole core: both are 4 s
    "cpu_loop": {"timeout", "killed"},
    # RLIMIT_NPROC holds them at 32 processes (about 10 MB resident each), which spin until
    # the wall clock or RLIMIT_CPU stops the program
    "fork_bomb": {"timeout", "killed"},
    "fork_bomb_ctypes": {"timeout", "killed"},
    "fork_bomb_subprocess": {"timeout", "killed"},
    "memory_bomb_many_processes": {"memory_limit"},
    "floods_stdout": {"output_limit"},
}
CLOCK = {"timeout", "killed"}  # the outcomes of a program only the clock or RLIMIT_CPU stops

# Calls only the seccomp tier's deny-list stops (supervisor.DENIED_SYSCALLS, the socket
# families, clone's namespace flags), each made so that without the filter it works or fails
# with another errno: the filter's errno then can only come from the filter.
SECCOMP_REFUSES = {
    "ptrace": errno.EPERM,  # PTRACE_TRACEME: works unfiltered
    "process_vm_readv": errno.EPERM,  # reads its own memory the way it would another's: works
    "unshare": errno.EPERM,  # a new user namespace: works unfiltered (needs no privilege)
    "clone": errno.EPERM,  # a child in a new user namespace: works
    "clone3": errno.ENOSYS,  # the same through clone3, whose flags a filter can't see: works
    "mount": errno.EPERM,  # onto a missing path: ENOENT unfiltered (looked up before privilege)
    "bpf": errno.EPERM,  # an unknown command: EINVAL unfiltered
    "keyctl": errno.EPERM,  # the id of the user keyring: works
    "socket_inet": errno.EAFNOSUPPORT,  # works (there is just no network)
    "socket_inet6": errno.EAFNOSUPPORT,
    "socket_netlink": errno.EAFNOSUPPORT,  # works
    "socket_packet": errno.EAFNOSUPPORT,  # EPERM unfiltered (no CAP_NET_RAW)
}
SYSCALL_NUMBERS = {
    "x86_64": {
        "ptrace": 101,
        "process_vm_readv": 310,
        "unshare": 272,
        "clone": 56,
        "clone3": 435,
        "mount": 165,
        "bpf": 321,
        "keyctl": 250,
    },
    "aarch64": {
        "ptrace": 117,
        "process_vm_readv": 270,
        "unshare": 97,
        "clone": 220,
        "clone3": 435,
        "mount": 40,
        "bpf": 280,
        "keyctl": 219,
    },
}
SECCOMP_PROGRAM = """
    import ctypes, json, os, socket

    libc = ctypes.CDLL(None, use_errno=True)
    NR = SYSCALL_NUMBERS


    def syscall(name, *args):
        # The bare system call, so that no libc wrapper emulates or hides it: 0 if it worked,
        # else its errno. A child made by clone comes back here as from fork(), and leaves.
        # Numbers go as longs: syscall() reads longs, a bare int is half a stack slot.
        args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
        ctypes.set_errno(0)
        ret = libc.syscall(ctypes.c_long(NR[name]), *args)
        if ret == -1:
            return ctypes.get_errno()
        if name.startswith("clone"):
            if ret == 0:
                os._exit(0)
            os.waitpid(ret, 0)
        return 0


    def in_child(name, *args):
        # Calls that change their caller (ptrace, namespaces) are made by a throwaway child,
        # which exits with the outcome.
        pid = os.fork()
        if pid == 0:
            os._exit(syscall(name, *args))
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


    def sock(family, kind):
        try:
            socket.socket(family, kind).close()
            return 0
        except OSError as err:
            return err.errno


    CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
    mine, copy = ctypes.create_string_buffer(b"peek"), ctypes.create_string_buffer(4)
    local = ctypes.byref((ctypes.c_void_p * 2)(ctypes.addressof(copy), 4))  # struct iovec {base, len}
    remote = ctypes.byref((ctypes.c_void_p * 2)(ctypes.addressof(mine), 4))
    clone_args = (ctypes.c_uint64 * 8)(CLONE_NEWUSER, 0, 0, 0, SIGCHLD)  # flags, ..., exit_signal
    ERR = {
        "ptrace": in_child("ptrace", 0, 0, 0, 0),
        "process_vm_readv": syscall("process_vm_readv", os.getpid(), local, 1, remote, 1, 0),
        "unshare": in_child("unshare", CLONE_NEWUSER),
        "clone": in_child("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0),
        "clone3": in_child("clone3", clone_args, ctypes.sizeof(clone_args)),
        "mount": syscall("mount", b"none", b"/nonexistent-plait-probe", b"tmpfs", 0, None),
        "bpf": syscall("bpf", 9999, None, 0),
        "keyctl": syscall("keyctl", 0, -4, 0),
        "socket_inet": sock(socket.AF_INET, socket.SOCK_STREAM),
        "socket_inet6": sock(socket.AF_INET6, socket.SOCK_STREAM),
        "socket_netlink": sock(socket.AF_NETLINK, socket.SOCK_RAW),
        "socket_packet": sock(socket.AF_PACKET, socket.SOCK_RAW),
    }
    print(json.dumps(ERR))
"""


def _need_tier(tier: str) -> None:
    why = sandbox.probe()[tier]
    if why is not None:
        pytest.skip(f"tier {tier} unavailable here: {why}")


# A sandbox run's processes: the harness (its path under the run's temp dir, or /run/sandbox
# inside bubblewrap), bubblewrap (which mounts /run/sandbox), and as root the run's uid.
SANDBOX_COMMANDS = ("plait-sbx-", "/run/sandbox")


def _sandbox_processes():
    """Live processes of this module's sandbox runs: our descendants that are sandbox
    processes, and anything with MARK on its command line (programs put it on what they exec).

    Only our descendants: other jobs on this machine run sandboxes too. A process that
    outlives its supervisor is re-parented to us (`adopt_orphans`), not to init, so it stays one.
    """
    me = os.getpid()
    try:
        ours = {p.pid for p in psutil.Process(me).children(recursive=True)}
    except psutil.Error:
        ours = set()
    out = []
    for p in psutil.process_iter(["ppid", "uids", "cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            sandboxed = p.info["uids"].real >= 1_000_000 or any(s in cmd for s in SANDBOX_COMMANDS)
            if MARK not in cmd and not (p.pid in ours and sandboxed):
                continue
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                if p.info["ppid"] == me:
                    os.waitpid(p.pid, os.WNOHANG)  # an orphan we adopted, dead: reap it
                continue
            out.append(p)
        except (psutil.Error, ChildProcessError, TypeError, AttributeError):
            pass
    return out


def _still_running(deadline_s: float = GRACE_S) -> list:
    """The sandbox's processes left after waiting up to `deadline_s` for them to go.

    A process SIGKILLed by the teardown may take a moment to vanish on a loaded machine; the
    programs' processes all run 60 s or more unless killed, so a survivor is still here."""
    end = time.monotonic() + deadline_s
    while (left := _sandbox_processes()) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def _leftover_dirs(before: set, code: str, deadline_s: float = 60.0) -> set:
    """Temp dirs of this test's run of `code` still in /tmp. Other sandbox runs (the other test
    worker's, other jobs') make plait-sbx-* dirs too: one whose program is another is left alone,
    one that can't be read is waited for (they go when their runs end, in well under a minute).
    Ours was removed before run_tests returned, so one that stays is a leftover."""
    new = {d for d in set(Path("/tmp").glob("plait-sbx-*")) - before if _may_run(d, code)}
    end = time.monotonic() + deadline_s
    while new and time.monotonic() < end:
        time.sleep(0.1)
        new = {d for d in new if os.path.lexists(d)}
    return new


def _limits_for(name: str) -> Limits:
    """The limits a hostile program runs under: its verdict must be its own doing, not a timeout,
    unless the clock is what is meant to stop it."""
    if name in RUN_TO_THE_END:
        return ROOMY
    if name in STOPPED_BY and STOPPED_BY[name] <= CLOCK:
        return CLOCKED
    return FAST


def _may_run(top: Path, code: str) -> bool:
    """Is the sandbox dir `top` a run of `code`, as far as its request file tells (unreadable:
    it may be)?"""
    try:
        return json.loads((top / "src" / "spec.json").read_text())["code"] == code
    except (OSError, ValueError, KeyError):
        return True


def _reached(srv: socket.socket, wait_s: float) -> bool:
    """Did anything connect to the trainer's port? A connection made is queued by the time
    the program's connect() returns, but on loopback the kernel may finish it in a deferred
    softirq on a busy machine: a program that knows the port is given `wait_s` to show up."""
    readable, _, _ = select.select([srv], [], [], wait_s)
    return bool(readable)


@pytest.fixture(scope="module", autouse=True)
def adopt_orphans():
    """Make this process a child subreaper for the module: a sandbox process that outlives its
    supervisor comes back to us instead of init, so `_sandbox_processes` can still tell it is ours."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())  # PR_SET_CHILD_SUBREAPER
    yield
    libc.prctl(36, 0, 0, 0, 0)


@pytest.fixture(scope="module", autouse=True)
def secret_in_trainer_env():
    """The secret in this process's os.environ now: what a child started without env= would
    inherit (the supervisor must not pass it on). /proc/<pid>/environ never shows it."""
    os.environ["PLAIT_TEST_SECRET"] = SECRET
    yield
    os.environ.pop("PLAIT_TEST_SECRET", None)


@pytest.fixture
def secret_holder():
    """The pid of a stand-in for the trainer: a process started with the secret in its
    environment, so that /proc/<pid>/environ holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"], env={**os.environ, "PLAIT_TEST_SECRET": SECRET}
    )
    try:
        # The attack can work: a process of the holder's uid reads the secret there. Popen
        # returns while the exec is still setting up the new image (environ reads empty
        # then): wait for it.
        entry, environ = f"PLAIT_TEST_SECRET={SECRET}".encode(), Path(f"/proc/{holder.pid}/environ")
        end = time.monotonic() + 60
        while entry not in environ.read_bytes().split(b"\0") and time.monotonic() < end:
            time.sleep(0.01)
        assert entry in environ.read_bytes().split(b"\0"), "the secret is not in the holder's /proc/<pid>/environ"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def host():
    """Snapshot of what a program could change; checked after it ran."""
    # lexists: False where we may not look (as a user, /root): the program, no stronger, can't write there
    assert not [p for p in OUTSIDE if os.path.lexists(p)]
    before = {"tmp_dirs": set(Path("/tmp").glob("plait-sbx-*"))}
    yield before
    written = [p for p in OUTSIDE + [REPO.parent / MARK] if os.path.lexists(p)]
    for p in written:
        with contextlib.suppress(OSError):
            p.unlink()
    assert not written, f"the program wrote {written}"


def _program(name: str, port: int = 0, helper_pid: int = 0, tier: str = "") -> str:
    src = textwrap.dedent(PROGRAMS[name])
    for key, value in (
        ("WORLD_WRITABLE", str(tier != "process")),
        ("HELPER_PID", str(helper_pid)),
        ("MARK", MARK),
        ("REPO", str(REPO)),
        ("PORT", str(port)),
        ("TRAINER", str(os.getpid())),
    ):
        src = src.replace(key, value)
    return src


@pytest.mark.parametrize("tier", sandbox.TIERS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_hostile_program_is_contained(name, tier, host, request):
    _need_tier(tier)
    if tier == "process" and name in NEEDS_NAMESPACES:
        pytest.skip("the process tier shares the host's network (documented)")
    as_the_runner = tier == "process" and not IS_ROOT and name in NEEDS_ROOT_IN_PROCESS_TIER
    if as_the_runner and name != "reads_secrets":
        pytest.skip(NEEDS_ROOT_IN_PROCESS_TIER[name])
    helper_pid = request.getfixturevalue("secret_holder") if "HELPER_PID" in PROGRAMS[name] else 0
    srv = _listener()
    try:
        src = _program(name, srv.getsockname()[1], helper_pid, tier)
        limits = _limits_for(name)
        res = run_tests(src, ["assert ESCAPED"], limits=limits, tier=tier)
        assert not _reached(srv, 5.0 if "PORT" in PROGRAMS[name] else 0.0), "the program reached the trainer's port"
    finally:
        srv.close()
    assert res.valid, res.error
    if name in RUN_TO_THE_END:
        assert res.finished, f"{name} did not run to its end ({res})"
    if name in STOPPED_BY:
        assert res.status in STOPPED_BY[name], f"{name} ended by {res.status}, not by its limit ({res})"
    assert len(res.stdout) <= limits.output_bytes and len(res.stderr) <= limits.output_bytes
    assert _still_running() == [], "processes outlived the sandbox"
    assert not _leftover_dirs(host["tmp_dirs"], src), "temp dir left behind"
    leaked = SECRET in res.stdout + res.stderr + "".join(res.errors)
    if as_the_runner and (res.passed or leaked):
        pytest.xfail(NEEDS_ROOT_IN_PROCESS_TIER[name])
    assert not res.all_passed and res.passed == [], f"{name}: the attack worked ({res})"
    assert not leaked, f"{name}: the secret leaked"


def test_the_secret_attack_works_without_a_sandbox(secret_holder):
    """Control for reads_secrets: the same program, run outside any sandbox as the holder's
    uid with an environment of its own that has no secret, finds the secret in /proc."""
    src = _program("reads_secrets", helper_pid=secret_holder) + "\nassert ESCAPED\n"
    out = subprocess.run(
        [sys.executable, "-c", src], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"PLAIT_TEST_SECRET={SECRET}" in out.stdout.splitlines()


@pytest.mark.parametrize("tier", sandbox.TIERS)
def test_seccomp_refuses_what_only_it_denies(tier):
    """In tier seccomp each call in SECCOMP_REFUSES fails with the filter's errno. In tier
    namespaces (the same sandbox, no filter) none does: the control showing that the errno
    comes from the filter. Tier process: recorded only (printed), nothing is promised."""
    _need_tier(tier)
    numbers = SYSCALL_NUMBERS.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no syscall numbers for {platform.machine()} here")
    src = textwrap.dedent(SECCOMP_PROGRAM).replace("SYSCALL_NUMBERS", repr(numbers))
    names = sorted(SECCOMP_REFUSES)
    compare = {"seccomp": "==", "namespaces": "!="}.get(tier)
    tests = [f"assert ERR[{n!r}] {compare} {SECCOMP_REFUSES[n]}, ERR[{n!r}]" for n in names] if compare else []
    res = run_tests(src, tests, limits=ROOMY, tier=tier)
    print(f"tier {tier}: errno per call (0: it worked): {res.stdout.strip()}")
    assert res.valid and res.finished, res
    failed = [n for i, n in enumerate(names) if i not in res.passed]
    if tier == "seccomp":
        assert failed == [], f"not refused by the filter as expected: {failed}; errnos: {res.stdout}"
    elif tier == "namespaces":
        assert failed == [], f"refused even without the filter, so the probe proves nothing: {failed}; {res.stdout}"


@pytest.mark.parametrize("tier", sandbox.TIERS)
def test_daemon_does_not_outlive_the_run(tier, host):
    """The double-fork daemon is up when the program ends; if it outlived the run it would
    write its mark and stay. Wait until it is gone: dead, it can do neither."""
    _need_tier(tier)
    if tier == "process" and not IS_ROOT:
        pytest.skip(NEEDS_ROOT_IN_PROCESS_TIER["double_fork_daemon"])
    res = run_tests(_program("double_fork_daemon"), ["assert UP"], limits=ROOMY, tier=tier)
    assert res.valid and res.all_passed, f"the daemon was not up when the program ended: {res}"
    left = _still_running(deadline_s=60)
    assert left == [], f"the daemon outlived the run: {left}"
    # its mark (the host fixture checks /tmp and /dev/shm) would have been written before it stayed on


def test_outcomes_are_reported_by_cause():
    tier = sandbox.active_tier()
    assert run_tests("import time\ntime.sleep(30)", [], limits=CLOCKED, tier=tier).status == "timeout"
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


def test_a_caller_with_many_threads_still_runs_programs():
    """RLIMIT_NPROC counts threads, per real uid. Not as root the program shares the caller's uid,
    so the limit it gets must count the caller's threads (a process with a vLLM engine runs
    dozens): counting only processes made every call fail as a non-root user, bwrap's clone
    refused with EAGAIN. As root each run has a uid of its own; the call must succeed there too."""
    from plait.sandbox.supervisor import tasks_of_user

    tiers = sandbox.probe()
    stop = threading.Event()
    before = tasks_of_user(os.getuid())
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3 * FAST.max_processes)]
    for t in threads:
        t.start()
    try:
        assert tasks_of_user(os.getuid()) >= before + len(threads)
        # every tier that works still works: none is lost to the caller's threads (the probe, too,
        # runs a program: it would otherwise settle on a weaker tier without a word)
        assert sandbox.probe(refresh=True) == tiers
        for tier in (t for t, why in tiers.items() if why is None):
            res = run_tests("x = 6 * 7", ["assert x == 42"], limits=FAST, tier=tier)
            assert res.all_passed and res.tier == tier, res
    finally:
        stop.set()
        sandbox.probe(refresh=True)


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
