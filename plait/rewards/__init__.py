"""Reward functions: plain callables over completions and dataset columns.

    def my_reward(completions: list[str], **kwargs) -> list[float | None]

kwargs hold `prompts`, `completion_ids`, `answer` and every other dataset column, one value
per completion (the same keywords TRL passes, so TRL reward functions work unchanged; with
conversational data user functions get prompts as message lists and completions as assistant
messages, as in TRL: see runner.RewardInputs).
Return one float per completion. A config names a built-in (`accuracy`), any importable
function or class (`my_pkg.rewards:my_reward`), or a local reward-model folder.
"""

from __future__ import annotations

import functools
import inspect
import os
import traceback
from typing import Callable

from plait import imports
from plait.programs.environments import environment
from plait.rewards.code import code_pass, code_tests_passed
from plait.rewards.format import boxed_format, reasoning_steps, tag_count, think_format
from plait.rewards.length import cosine_length, length_penalty, soft_overlong_punishment
from plait.rewards.math import accuracy, boxed_accuracy
from plait.rewards.model import reward_model
from plait.rewards.repetition import repetition_penalty


RewardFn = Callable[..., list]

BUILTIN: dict[str, RewardFn] = {
    "accuracy": accuracy,
    "boxed_accuracy": boxed_accuracy,
    "boxed_format": boxed_format,
    "think_format": think_format,
    "length_penalty": length_penalty,
    "soft_overlong_punishment": soft_overlong_punishment,
    "tag_count": tag_count,
    "reasoning_steps": reasoning_steps,
    "cosine_length": cosine_length,
    "repetition_penalty": repetition_penalty,
    "reward_model": reward_model,
    "code_pass": code_pass,
    "code_tests_passed": code_tests_passed,
    "environment": environment,
}


def resolve_reward(name: str) -> RewardFn:
    """A built-in by name, `module:function` imported from the Python path (a class there is
    called through an instance made without arguments), or a local reward-model folder (scored
    by `reward_model`, as TRL takes a model path for a reward function)."""
    if name in BUILTIN:
        return BUILTIN[name]
    if os.path.isfile(os.path.join(name, "config.json")):
        return functools.partial(reward_model, path=name)
    if ":" not in name:
        import difflib

        near = difflib.get_close_matches(name, list(BUILTIN), n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise KeyError(
            f"unknown reward '{name}'.{hint} Built-ins: {', '.join(sorted(BUILTIN))}; or give 'module:function' "
            "or 'path/to/file.py:function'"
        )
    module, _, attr = name.partition(":")
    try:
        found = imports.import_module(module)
    except ImportError as err:
        where = (
            "a path to a .py file"
            if imports.is_file(module)
            else "modules are found on PYTHONPATH and in the current directory; or give a .py file's path"
        )
        raise KeyError(f"reward '{name}' could not be imported: {err} ({where})") from None
    except Exception as err:  # the file itself fails: a syntax error, or its top-level code raises
        raise KeyError(f"reward '{name}': importing {module} failed: {_where_it_failed(err)}") from None
    fn = getattr(found, attr, None)
    if fn is None:
        raise KeyError(f"reward '{name}': {module} has no function '{attr}'{imports.nearest(found, attr)}")
    if inspect.isclass(fn):
        try:
            fn = fn()
        except Exception as err:
            raise KeyError(
                f"reward '{name}' is a class, and making an instance without arguments failed: {err}"
            ) from None
    if not callable(fn):
        raise KeyError(f"reward '{name}' is not callable")
    return fn


def _where_it_failed(err: Exception) -> str:
    """The error with the user's file and line (a syntax error's own, else the innermost frame
    outside plait), so the message points at what to fix."""
    if isinstance(err, SyntaxError):
        return f"{type(err).__name__}: {err.msg} ({err.filename}, line {err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def uses_sandbox(cfg) -> bool:
    """Does a configured reward, or the eval metric, execute code?"""
    names = [r.name for r in cfg.rewards] + [cfg.eval.metric]
    return any(getattr(resolve_reward(name), "needs_sandbox", False) for name in names)
