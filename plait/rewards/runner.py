"""Call the configured reward functions on a step's groups and check what they return.

A reward that raises, returns the wrong number of values, or returns NaN/inf stops the run
with a RewardError that names the function and the offending sample, before the policy is
updated (so no checkpoint ever holds weights trained on a broken reward).

Scoring returns its cost with its values (a RewardReport: seconds and timeouts per reward,
the sandbox's executions), so the caller decides which calls count towards a training step.
User reward functions are called as TRL calls them, `fn(completions=..., prompts=..., **columns,
**kwargs)`: `prompts` as the dataset gave them (strings, or lists of chat messages), and for
conversational data (chat messages) each completion as `[{"role": "assistant", "content": text}]`
(a multi-turn completion as its whole conversation, each turn under its role), else as a string.
Built-in rewards always get strings. A string is what the model wrote: a multi-turn completion's
model turns, never a tool's output or an agent's turn between them (those, with the turns, are
the `transcript` column). Only a function marked `needs_sandbox`
(the code rewards) also gets `sandbox=`, the run's Sandbox. `trainer_state` says where the run
is (`global_step`: rounds done, `max_steps`), as TRL passes its TrainerState.

Sync functions from users' modules run in a process of their own (rewards/worker.py), on its
main thread, as TRL calls them: signal-based time limits (math-verify's defaults) work there,
and a call past its timeout_s is killed. Built-ins, async functions and sandboxed ones run on
threads of the trainer.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import threading
import time
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from plait import imports
from plait.rewards.worker import RewardCallFailed, RewardProcess
from plait.types import Group


if TYPE_CHECKING:
    from plait.sandbox.box import Sandbox


log = logging.getLogger("plait.rewards")

SANDBOX_COUNTS = ("executions", "seconds", "invalid", "cached")


class RewardError(RuntimeError):
    pass


def _add(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


@dataclass
class RewardReport:
    """What scoring cost: seconds each reward's calls took (they run side by side), calls that
    ran past their timeout_s, and the sandbox's counts (executions, seconds, invalid, cached;
    empty when no sandbox was involved); and the last error of each environment whose verifier
    failed (plait's `environment` reward fills it), for the run's stop message."""

    seconds: dict[str, float] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)
    sandbox: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def merge(self, other: RewardReport) -> RewardReport:
        """Both reports' costs summed (several scoring rounds of one step), the later errors kept."""
        return RewardReport(
            _add(self.seconds, other.seconds),
            _add(self.timeouts, other.timeouts),
            _add(self.sandbox, other.sandbox),
            {**self.errors, **other.errors},
        )

    def metrics(self, names: list[str], sandboxed: bool) -> dict[str, float]:
        """reward/<name>/timeouts and reward/<name>/seconds for every configured reward (0 when it
        was not called), and sandbox/* when the run uses the sandbox: the same keys in every
        process, so they can be summed across processes. Calls of other functions (the eval
        metric) are not a reward's cost and are left out."""
        out = {f"reward/{name}/timeouts": float(self.timeouts.get(name, 0)) for name in names}
        out.update({f"reward/{name}/seconds": float(self.seconds.get(name, 0.0)) for name in names})
        if sandboxed:
            out.update({f"sandbox/{k}": float(self.sandbox.get(k, 0)) for k in SANDBOX_COUNTS})
        return out


@dataclass
class BoundReward:
    name: str
    fn: Callable[..., list]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    sandbox: Sandbox | None = None  # given to a function that needs_sandbox (None: its default one)
    builtin: bool = False  # plait's own: completions always as strings
    process: RewardProcess | None = None  # where it runs when not on the trainer's threads
    said_all_none: bool = field(default=False, compare=False)  # warned that it scored nothing (once a run)

    @property
    def needs_sandbox(self) -> bool:
        return getattr(self.fn, "needs_sandbox", False)


@dataclass
class RewardInputs:
    """What reward functions are called with, one entry per completion: the completion texts,
    the keyword columns, and whether the prompts are chat messages (then user functions get
    each completion as an assistant message, TRL's convention)."""

    texts: list[str]
    kwargs: dict[str, Any]
    conversational: bool = False
    messages: list[list[dict] | None] | None = None  # multi-turn completions as their whole conversation

    def completions_for(self, reward: BoundReward) -> list:
        if self.conversational and not reward.builtin:
            messages = self.messages or [None] * len(self.texts)
            return [m or [{"role": "assistant", "content": t}] for t, m in zip(self.texts, messages)]
        return self.texts


def bind_rewards(specs, sandbox: Sandbox | None = None) -> list[BoundReward]:
    """Config RewardSpecs -> callables (raises KeyError naming any that can't be found); the
    code rewards among them execute in `sandbox`."""
    return [_bind(s.name, sandbox, s.weight, dict(s.kwargs), s.timeout_s, s.process) for s in specs]


def close_rewards(rewards: list[BoundReward]) -> None:
    """End the rewards' own processes."""
    for r in rewards:
        if r.process is not None:
            r.process.close()


def runs_in_process(name: str, fn, process: bool | None) -> bool:
    """Does reward `name` (resolved to `fn`) run in a process of its own? `process` null: yes
    for a sync function from the user's own module, no for built-ins, async functions and
    functions that need the sandbox (a Sandbox can't cross processes)."""
    if process is not None:
        return process
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return ":" in name and not is_async and not getattr(fn, "needs_sandbox", False)


def process_target(name: str, fn) -> tuple[str, str] | None:
    """(module, attribute) a worker process imports to get `fn`, or None when it has no such
    name (a reward-model folder, a lambda)."""
    from plait.rewards import BUILTIN

    if name in BUILTIN:
        return fn.__module__, fn.__name__
    module, sep, attr = name.partition(":")
    if imports.is_file(module):  # the worker may start elsewhere: name the file absolutely
        module = imports.file_path(module)
    return (module, attr) if sep and "." not in attr else None


def bind_metric(name: str, sandbox: Sandbox | None = None) -> BoundReward:
    """The eval metric (a reward function by name, weight 1); a code metric executes in `sandbox`."""
    return _bind(name, sandbox)


def _bind(
    name: str,
    sandbox: Sandbox | None,
    weight: float = 1.0,
    kwargs: dict | None = None,
    timeout_s: float | None = None,
    process: bool | None = None,
) -> BoundReward:
    """The reward called `name`; only a function that needs_sandbox is given the sandbox."""
    from plait.rewards import BUILTIN, resolve_reward

    fn = resolve_reward(name)
    box = sandbox if getattr(fn, "needs_sandbox", False) else None
    worker = None
    if runs_in_process(name, fn, process):
        target = process_target(name, fn)
        if target is None:
            raise KeyError(f"reward '{name}' can't run in a process of its own (set process: false)")
        worker = RewardProcess(name, *target)
    return BoundReward(name, fn, weight, kwargs or {}, timeout_s, box, builtin=name in BUILTIN, process=worker)


def reward_inputs(groups: list[Group], step: int | None = None, max_steps: int | None = None) -> RewardInputs:
    """Completion texts and the keyword columns (one entry per completion) for reward calls;
    `trainer_state` too when the round `step` is given."""
    texts, messages, kwargs = [], [], {"prompts": [], "completion_ids": [], "answer": []}
    # every dataset column by its own name; `answer` is always the reference (data.answer_field)
    extra = sorted({k for g in groups for k in g.prompt.columns} - set(kwargs) - {"completions"})
    for k in extra:
        kwargs.setdefault(k, [])
    for g in groups:
        for c in g.completions:
            texts.append(c.scored_text)  # the model's own words, never an added turn
            messages.append(c.messages)
            kwargs["prompts"].append(g.prompt.text if g.prompt.source is None else g.prompt.source)
            kwargs["completion_ids"].append(c.token_ids)
            kwargs["answer"].append(g.prompt.answer)
            for k in extra:
                kwargs[k].append(g.prompt.columns.get(k))
    if any(c.env_reward is not None or c.env_error is not None for g in groups for c in g.completions):
        # trl_env rollouts: what each environment's get_reward said (the `environment` reward reads it)
        kwargs["env_reward"] = [c.env_reward for g in groups for c in g.completions]
        kwargs["env_error"] = [c.env_error for g in groups for c in g.completions]
    if any(c.model_text is not None for g in groups for c in g.completions):
        # multi-turn: everything after the prompt, added turns included (`accuracy`'s read: transcript)
        kwargs["transcript"] = [c.text for g in groups for c in g.completions]
    for key in sorted({k for g in groups for c in g.completions for k in c.columns or {}}):
        kwargs[key] = [(c.columns or {}).get(key) for g in groups for c in g.completions]  # the program's own
    if step is not None:  # rounds done so far, as TRL's TrainerState.global_step counts optimizer steps
        kwargs["trainer_state"] = types.SimpleNamespace(global_step=step - 1, max_steps=max_steps)
    conversational = any(isinstance(g.prompt.source, list) for g in groups)
    return RewardInputs(texts, kwargs, conversational, messages if any(messages) else None)


def _sample(texts: list[str], i: int) -> str:
    t = texts[i]
    return repr(t if len(t) <= 120 else t[:117] + "...")


def keywords_for(fn, columns: dict, own: dict) -> dict:
    """The keywords a reward is called with: the reward's `own` (its config kwargs, the sandbox)
    always, and of the `columns` plait passes all (a function with **kwargs, TRL's convention)
    or only those it names, so `def f(completions, answer)` works too. A parameter without a
    default that nobody passes is named, with what plait does pass."""
    passed = {**columns, **own}
    signature = _parameters(fn)
    if signature is None:  # no signature to read: everything
        return passed
    named, takes_any = signature
    missing = _unfilled(named, passed)
    if missing:
        raise TypeError(
            f"it takes {', '.join(map(repr, missing))}, which is not passed: plait passes completions, "
            f"{', '.join(sorted(passed))} (each data column by its own name); rename the parameter, give it a "
            "default, or add the column to the data"
        )
    if takes_any:  # **kwargs (TRL's convention): everything
        return passed
    names = {p.name for p in named}
    return {**{k: v for k, v in columns.items() if k in names}, **own}


def _parameters(fn) -> tuple[list[inspect.Parameter], bool] | None:
    """`fn`'s parameters that take a keyword, and whether it has **kwargs too; None when it has
    no signature to read (a C callable)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def _named_parameters(fn) -> list[inspect.Parameter] | None:
    """`fn`'s parameters that take a keyword; None when it has **kwargs (it takes any) or no
    signature to read."""
    signature = _parameters(fn)
    return None if signature is None or signature[1] else signature[0]


def unfilled_parameters(fn, passed) -> list[str]:
    """`fn`'s parameters without a default that none of the keywords `passed` (and
    `completions`) fills, whether or not it also takes **kwargs."""
    signature = _parameters(fn)
    return _unfilled(signature[0], passed) if signature else []


def _unfilled(named: list[inspect.Parameter], passed) -> list[str]:
    return [p.name for p in named if p.default is p.empty and p.name not in passed and p.name != "completions"]


# what every reward call passes beside the data's columns (the eval metric's has no trainer_state)
PASSED_ALWAYS = ("prompts", "completion_ids", "answer", "trainer_state")


def untaken_keywords(fn, names) -> list[str]:
    """Of `names` (a reward's config kwargs), those `fn` takes no parameter for (none when it
    has **kwargs, or no signature to read)."""
    named = _named_parameters(fn)
    if named is None:
        return []
    return [n for n in names if n not in {p.name for p in named}]


def call_reward(reward: BoundReward, inputs: RewardInputs) -> list[float | None]:
    """One reward over all completions, checked: len == len(texts), finite floats or None."""
    return _timed_call(reward, inputs)[0]


def reports_errors(reward: BoundReward) -> bool:
    """One of plait's own rewards that says what failed in an `errors` dict it is handed (the
    `environment` reward: its verifiers' exceptions), in this process."""
    signature = _parameters(reward.fn) if reward.builtin and reward.process is None else None
    return signature is not None and any(p.name == "errors" for p in signature[0])


def _timed_call(reward: BoundReward, inputs: RewardInputs) -> tuple[list[float | None], float, dict[str, str]]:
    """call_reward, the seconds it took, and the errors it reported (reports_errors)."""
    extra = {"sandbox": reward.sandbox} if reward.needs_sandbox and reward.sandbox is not None else {}
    errors: dict[str, str] = {}
    if reports_errors(reward):
        extra["errors"] = errors
    texts = inputs.texts
    first = _sample(texts, 0) if texts else "-"
    where = f"(on a batch of {len(texts)} completions; the first was {first}{_null_columns(inputs)})"
    t0 = time.perf_counter()
    try:
        if reward.process is not None:  # (its worker's function is the same as reward.fn)
            kwargs = keywords_for(reward.fn, inputs.kwargs, {**reward.kwargs, **extra})
            values = reward.process.call(inputs.completions_for(reward), kwargs)
        else:  # its own copies: a reward that edits its inputs changes nothing the next one reads
            columns = {k: copy.deepcopy(v) if isinstance(v, list) else v for k, v in inputs.kwargs.items()}
            kwargs = keywords_for(reward.fn, columns, {**reward.kwargs, **extra})
            values = reward.fn(completions=copy.deepcopy(inputs.completions_for(reward)), **kwargs)
        if inspect.isawaitable(values):  # an async reward: run it to completion on this thread
            values = asyncio.run(_awaited(values))
    except RewardCallFailed as err:
        tail = f"\n{err.remote_traceback.rstrip()}" if err.remote_traceback else ""
        raise RewardError(f"reward '{reward.name}' {_failure(err)} {where}{tail}") from None
    except Exception as err:
        raise RewardError(f"reward '{reward.name}' raised {type(err).__name__}: {err} {where}") from err
    seconds = time.perf_counter() - t0
    return _checked(reward, texts, values), seconds, errors


# columns plait fills in itself, where None is a value of its own (no environment reward, no error)
_OWN_COLUMNS = ("env_reward", "env_error")


def _null_columns(inputs: RewardInputs) -> str:
    """The data columns that are None for some of the batch's completions (their rows lack the
    field, or hold null): the usual cause of a reward raising on one batch and not another."""
    n = len(inputs.texts)
    found = [
        f"{k} is None for {nulls} of them"
        for k, v in inputs.kwargs.items()
        if k not in _OWN_COLUMNS and isinstance(v, list) and len(v) == n and (nulls := sum(x is None for x in v))
    ]
    return f"; {', '.join(found)}: their rows lack the field or hold null" if found else ""


def _failure(err: RewardCallFailed) -> str:
    if err.kind in ("WorkerDied", "Killed"):
        return f"failed: {err}"
    return f"raised {err.kind}: {err}"


def _checked(reward: BoundReward, texts: list[str], values) -> list[float | None]:
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward '{reward.name}' returned {type(values).__name__}, expected a list of floats"
        ) from None
    if len(values) != len(texts):
        raise RewardError(
            f"reward '{reward.name}' returned {len(values)} values for {len(texts)} completions "
            "(it must return exactly one float, or None, per completion)"
        )
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward '{reward.name}' returned {v!r} for completion {i} {_sample(texts, i)}: not a number"
            ) from None
        if not math.isfinite(f):
            raise RewardError(
                f"reward '{reward.name}' returned {f} for completion {i} {_sample(texts, i)}: rewards must be finite"
            )
        out.append(f)
    return out


async def _awaited(awaitable):
    return await awaitable


def call_rewards(
    rewards: list[BoundReward], inputs: RewardInputs, sandbox: Sandbox | None = None
) -> tuple[dict[str, list[float | None]], RewardReport]:
    """Every reward over the same completions, all at once (one thread each, so a slow judge
    or sandbox doesn't hold up the rest), and what that cost. A call past its timeout_s gives
    None for that step (excluded, not 0), a warning and a count in the report's timeouts (its
    seconds are those waited for it); a reward in a process of its own is killed there (the
    next call starts a new one), one on a thread is left to finish. The report's sandbox counts
    are `sandbox`'s executions during this call (default: those of the sandbox the rewards
    are bound to)."""
    if sandbox is not None:
        boxes = [sandbox]
    else:
        boxes = list({id(r.sandbox): r.sandbox for r in rewards if r.sandbox is not None}.values())
    before = [box.counts() for box in boxes]
    report = RewardReport()
    if len(rewards) == 1 and rewards[0].timeout_s is None:
        values, seconds, errors = _timed_call(rewards[0], inputs)
        out = {rewards[0].name: values}
        report.seconds[rewards[0].name] = seconds
        report.errors.update(errors)
    else:
        out = _call_in_parallel(rewards, inputs, report)
    for box, counts in zip(boxes, before):
        now = box.counts()
        report.sandbox = _add(report.sandbox, {k: now[k] - counts[k] for k in SANDBOX_COUNTS})
    return out, report


def _call_in_parallel(
    rewards: list[BoundReward], inputs: RewardInputs, report: RewardReport
) -> dict[str, list[float | None]]:
    texts = inputs.texts
    t0 = time.perf_counter()
    calls = {r.name: _OnThread(_timed_call, r, inputs) for r in rewards}
    out = {}
    for r in rewards:
        try:
            out[r.name], report.seconds[r.name], errors = calls[r.name].result(timeout=r.timeout_s)
            report.errors.update(errors)
        except TimeoutError:
            if r.process is not None:
                r.process.kill()  # its thread sees the end and returns; the next call restarts it
            report.timeouts[r.name] = report.timeouts.get(r.name, 0) + 1
            report.seconds[r.name] = time.perf_counter() - t0
            log.warning(
                "reward '%s' took longer than %ss on %d completions: scored None (excluded) this step",
                r.name,
                r.timeout_s,
                len(texts),
            )
            out[r.name] = [None] * len(texts)
    return out


class _OnThread:
    """fn(*args) on a daemon thread of its own. Not a pool's: Python joins a pool's threads
    when it exits, so a reward stuck past its timeout would keep the finished run from ending."""

    def __init__(self, fn, *args):
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), name="plait-reward", daemon=True)
        self.thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self.value = fn(*args)
        except BaseException as err:  # handed to the caller, raised there
            self.error = err

    def result(self, timeout: float | None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError
        if self.error is not None:
            raise self.error
        return self.value


def environment_failures(groups: list[Group], per_reward: dict[str, list], columns: dict) -> list[bool]:
    """Per completion: did its environment fail? A trl_env rollout whose reset or get_reward
    failed (`env_error`), or a row from an environment whose verifier raised or timed out (the
    `environment` reward None where the row has an environment to score it)."""
    failed = [c.env_error is not None for g in groups for c in g.completions]
    verified, sources = per_reward.get("environment"), columns.get("env_source")
    if verified is not None and sources is not None:
        failed = [f or (s is not None and v is None) for f, s, v in zip(failed, sources, verified)]
    return failed


def _warn_if_all_none(users: list[BoundReward], per_reward: dict[str, list], report: RewardReport) -> None:
    """A user's reward that scored none of a round's completions (not a timeout) teaches nothing:
    say so once a run (the bound reward remembers), since None reads as 'not applicable' and the
    round's log shows a plain 0. (The built-ins' None is an infrastructure error or a missing
    reference, reported where it arises.)"""
    for reward, name, values in ((r, r.name, per_reward[r.name]) for r in users):
        if values and all(v is None for v in values) and not report.timeouts.get(name) and not reward.said_all_none:
            reward.said_all_none = True
            log.warning(
                "reward '%s' returned None for all %d completions of a round: None means 'not applicable' and adds "
                "nothing, so it gives no signal; return 0.0 for a wrong answer",
                name,
                len(values),
            )


def score_groups(
    groups: list[Group],
    rewards: list[BoundReward],
    sandbox: Sandbox | None = None,
    step: int | None = None,
    max_steps: int | None = None,
) -> RewardReport:
    """Fill each group's per-reward scores and weighted total in place; return what scoring
    cost (see call_rewards).

    None means "not applicable": it adds nothing to the total (and is left out of that
    reward's logged mean). A rollout whose environment failed is scored None by every reward,
    shaping rewards included: an infrastructure error is not a score.
    """
    inputs = reward_inputs(groups, step, max_steps)
    per_reward, report = call_rewards(rewards, inputs, sandbox)
    _warn_if_all_none([r for r in rewards if not r.builtin], per_reward, report)
    failed = environment_failures(groups, per_reward, inputs.kwargs)
    if any(failed):
        per_reward = {name: [None if f else v for v, f in zip(vals, failed)] for name, vals in per_reward.items()}
    i = 0
    for g in groups:
        n = len(g.completions)
        g.rewards = {name: vals[i : i + n] for name, vals in per_reward.items()}
        g.total = [
            sum(r.weight * g.rewards[r.name][j] for r in rewards if g.rewards[r.name][j] is not None) for j in range(n)
        ]
        i += n
    return report
