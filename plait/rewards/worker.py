"""The trainer's side of a reward function's own process (the process is plait/_reward_worker.py).

A RewardProcess starts its worker on the first call and keeps it for the run: the reward's
imports and caches are paid once. A call that runs past its time limit is stopped by `kill`
(from the thread that waited for it); the next call starts a fresh worker. A worker that
dies by itself (a crash, os._exit, a signal) is the reward's error.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref


class RewardCallFailed(RuntimeError):
    """The reward raised in its worker (type, message and its traceback there), or the worker died."""

    def __init__(self, kind: str, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.kind = kind
        self.remote_traceback = remote_traceback


_LIVE: weakref.WeakSet = weakref.WeakSet()


class RewardProcess:
    def __init__(self, name: str, module: str, attr: str):
        self.name, self.module, self.attr = name, module, attr
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one call at a time; a killed call releases it on EOF
        self._killed = False
        _LIVE.add(self)

    def call(self, completions: list, kwargs: dict) -> list:
        """The reward's values over `completions` (raises RewardCallFailed)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._write((completions, kwargs))
            except (BrokenPipeError, OSError):
                raise self._died() from None
            return self._read()

    def _start(self) -> None:
        self._killed = False
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "plait._reward_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # killable with everything it started; Ctrl-C goes to the trainer only
            env={**os.environ, "PLAIT_REWARD_WORKER": self.name},
        )
        self._write({"module": self.module, "attr": self.attr, "sys_path": list(sys.path), "parent": os.getpid()})
        try:
            reply = pickle.load(self._proc.stdout)
        except (EOFError, pickle.UnpicklingError):
            raise self._died() from None
        if reply[0] == "error":
            raise RewardCallFailed(reply[1], f"could not be loaded in its process: {reply[2]}", reply[3])

    def _write(self, message) -> None:
        self._proc.stdin.write(pickle.dumps(message))
        self._proc.stdin.flush()

    def _read(self) -> list:
        try:
            reply = pickle.load(self._proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            raise self._died() from None
        if reply[0] == "error":
            raise RewardCallFailed(reply[1], reply[2], reply[3])
        return reply[1]

    def _died(self) -> RewardCallFailed:
        if self._killed:
            return RewardCallFailed("Killed", "stopped past its time limit")
        code = self._proc.wait()
        how = f"by signal {signal.Signals(-code).name}" if code < 0 else f"with exit code {code}"
        return RewardCallFailed("WorkerDied", f"its process ended {how} during the call")

    def kill(self) -> None:
        """Stop the call in progress (and anything the reward started); the next call restarts."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._killed = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """End the worker: EOF on its stdin ends it; one that doesn't within 5 s is killed."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        finally:
            proc.stdout.close()


@atexit.register
def _close_all() -> None:
    for worker in list(_LIVE):
        worker.close()
