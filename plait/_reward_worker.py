"""A reward function's own process: `python -m plait._reward_worker`.

Sync reward functions from users' modules run here, one process per function, on its main
thread, as TRL runs them: libraries that rely on signals (math-verify's default time limits use
signal.alarm, which only works on a main thread) work unmodified, the rewards still run side by
side, and a call past its time limit is stopped by killing the process (a thread can't be).

The protocol is pickled tuples on the process's stdin/stdout; whatever the reward prints goes
to stderr (the trainer's). This module imports nothing from plait (no torch), so a worker
starts in the time its reward's own imports take.

    parent -> {"module", "attr", "sys_path", "parent"}      once
    worker -> ("ready",) | ("error", type, message, traceback)
    parent -> (completions, kwargs)                          per call
    worker -> ("ok", values) | ("error", type, message, traceback)
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import sys
import threading
import time
import traceback


def load_function(module: str, attr: str):
    """`module:attr`, instantiated when it is a class (a reward given as a class is called
    through an instance, as TRL calls reward classes)."""
    from plait.imports import import_module

    fn = getattr(import_module(module), attr)
    return fn() if inspect.isclass(fn) else fn


def _error(err: BaseException, own_frames: int = 0) -> tuple:
    """The error as the trainer reports it, its traceback without this module's own frames."""
    tb = err.__traceback__
    for _ in range(own_frames):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return ("error", type(err).__name__, str(err), "".join(traceback.format_exception(type(err), err, tb)))


def _call(fn, completions, kwargs) -> tuple:
    try:
        values = fn(completions=completions, **kwargs)
        if inspect.isawaitable(values):
            values = asyncio.run(_awaited(values))
    except BaseException as err:  # sys.exit() in a reward is its error too, not the worker's end
        return _error(err, own_frames=1)
    try:
        return ("ok", list(values))
    except TypeError:
        return ("ok", values)  # not a sequence: the trainer's check names the type it got


async def _awaited(awaitable):
    return await awaitable


def _watch_parent(parent: int) -> None:
    """Exit when the trainer is gone (a reward stuck in a loop would otherwise outlive it)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _send(out, message: tuple) -> None:
    try:
        data = pickle.dumps(message)
    except Exception as err:
        data = pickle.dumps(
            ("error", "PicklingError", f"its return value can't be sent back to the trainer ({err})", "")
        )
    out.write(data)
    out.flush()


def main() -> None:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the reward's prints go to the trainer's stderr, never into the protocol
    sys.stdout = sys.stderr
    spec = pickle.load(proto_in)
    sys.path[:] = spec["sys_path"]
    threading.Thread(target=_watch_parent, args=(spec["parent"],), daemon=True).start()
    try:
        fn = load_function(spec["module"], spec["attr"])
    except BaseException as err:
        _send(proto_out, _error(err))
        return
    try:
        _send(proto_out, ("ready",))
        while True:
            completions, kwargs = pickle.load(proto_in)
            _send(proto_out, _call(fn, completions, kwargs))
    except (EOFError, BrokenPipeError):  # the trainer closed the pipe, or is gone
        return


if __name__ == "__main__":
    main()
