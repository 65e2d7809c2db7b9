"""Every Python process's start, end and CPU time, for bench/suite_timeline.py: with this folder on
PYTHONPATH and PLAIT_PROCLOG set to a file, each Python process that starts (a test's `plait
train`, torchrun, vLLM's spawned processes, reward workers) appends one line to it as it exits
normally. A process killed by a signal, or one that leaves through os._exit, writes nothing.
Python imports `sitecustomize` at start-up from the path: nothing here runs without the variable."""

import atexit
import json
import os
import resource
import sys
import time


_START = time.time()


def _write(path: str) -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    row = {"argv": " ".join(sys.argv)[:300], "start": _START, "end": time.time()}
    row.update(user=used.ru_utime, sys=used.ru_stime, pid=os.getpid(), ppid=os.getppid())
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


if os.environ.get("PLAIT_PROCLOG"):
    atexit.register(_write, os.environ["PLAIT_PROCLOG"])
