"""`plait ARGS` as its command-line entry runs it, in the test's own process: for tests that assert a
command's exit code and what it printed, not anything of a process of its own."""

from __future__ import annotations

import contextlib
import io
import subprocess


def plait_here(*args: str) -> subprocess.CompletedProcess:
    """Exit code (argparse's own for a bad argument too), stdout and stderr of `plait ARGS`."""
    from plait.cli import main

    said, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse's usage message and exit code
            code = stop.code
    return subprocess.CompletedProcess(["plait", *args], code, said.getvalue(), err.getvalue())
