"""Runs inside the sandbox: load the program, run each test, report over a private pipe.

Usage: python -I -S harness.py NONCE_FD RESULT_FD, with spec.json beside this file:
{"code": the program, "setup": run after it, "tests": [statements, one test each]}.

Results never travel over stdout (the program controls stdout and may print "PASSED"):
each record goes to RESULT_FD with a nonce read from NONCE_FD, which is closed before any
of the program runs. A program that exits early, or kills the harness, never gets its
"done" record written, and counts as failed. Standard library only (runs with -S).
"""

import json
import os
import sys


def main() -> None:
    nonce_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
    nonce = os.read(nonce_fd, 64).decode()
    os.close(nonce_fd)
    # Bind what reporting needs now: the program may monkeypatch os or json later.
    write, dumps, exc_text = os.write, json.dumps, (lambda e: f"{type(e).__name__}: {e}"[:300])

    def emit(**record):
        record["nonce"] = nonce
        write(result_fd, (dumps(record) + "\n").encode())

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "spec.json")) as f:
        spec = json.load(f)
    emit(event="start", tests=len(spec["tests"]))
    namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        exec(compile(spec["code"], "solution.py", "exec"), namespace)
        if spec.get("setup"):
            exec(compile(spec["setup"], "setup.py", "exec"), namespace)
    except BaseException as err:  # SystemExit too: exiting while loading is a failure
        emit(event="load_error", error=exc_text(err))
        sys.stdout.flush()
        os._exit(0)
    for i, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), namespace)
        except BaseException as err:
            emit(event="test", i=i, ok=False, error=exc_text(err))
        else:
            emit(event="test", i=i, ok=True)
    emit(event="done")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)  # no atexit handlers or finalizers of the program's objects after "done"


main()
