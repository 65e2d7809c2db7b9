"""Call the configured reward functions on a step's groups and check what they return.

A reward that raises, returns the wrong number of values, or returns NaN/inf stops the run
with a RewardError that names the function and the offending sample, before the policy is
updated (so no checkpoint ever holds weights trained on a broken reward).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from plait.types import Group


log = logging.getLogger("plait.rewards")


class RewardError(RuntimeError):
    pass


TIMEOUTS: Counter = Counter()  # reward name -> calls that ran past timeout_s (read per step)
SECONDS: Counter = Counter()  # reward name -> seconds its calls took (they run side by side; read per step)


@dataclass
class BoundReward:
    name: str
    fn: Callable[..., list]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None

    @property
    def needs_sandbox(self) -> bool:
        return getattr(self.fn, "needs_sandbox", False)


def bind_rewards(specs) -> list[BoundReward]:
    """Config RewardSpecs -> callables (raises KeyError naming any that can't be found)."""
    from plait.rewards import resolve_reward

    return [BoundReward(s.name, resolve_reward(s.name), s.weight, dict(s.kwargs), s.timeout_s) for s in specs]


def reward_inputs(groups: list[Group]) -> tuple[list[str], dict[str, list]]:
    """Completion texts and the keyword columns (one entry per completion) for reward calls."""
    texts, kwargs = [], {"prompts": [], "completion_ids": [], "answer": []}
    extra = sorted({k for g in groups for k in g.prompt.columns})
    for k in extra:
        kwargs.setdefault(k, [])
    for g in groups:
        for c in g.completions:
            texts.append(c.text)
            kwargs["prompts"].append(g.prompt.text)
            kwargs["completion_ids"].append(c.token_ids)
            kwargs["answer"].append(g.prompt.answer)
            for k in extra:
                kwargs[k].append(g.prompt.columns.get(k))
    return texts, kwargs


def _sample(texts: list[str], i: int) -> str:
    t = texts[i]
    return repr(t if len(t) <= 120 else t[:117] + "...")


def call_reward(reward: BoundReward, texts: list[str], kwargs: dict[str, list]) -> list[float | None]:
    """One reward over all completions, checked: len == len(texts), finite floats or None."""
    t0 = time.perf_counter()
    try:
        values = reward.fn(completions=texts, **kwargs, **reward.kwargs)
        if inspect.isawaitable(values):  # an async reward: run it to completion on this thread
            values = asyncio.run(_awaited(values))
    except Exception as err:
        raise RewardError(
            f"reward '{reward.name}' raised {type(err).__name__}: {err} "
            f"(on a batch of {len(texts)} completions; the first was {_sample(texts, 0) if texts else '-'})"
        ) from err
    finally:
        SECONDS[reward.name] += time.perf_counter() - t0
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward '{reward.name}' returned {type(values).__name__}, expected a list of floats") from None
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
            raise RewardError(f"reward '{reward.name}' returned {v!r} for completion {i} {_sample(texts, i)}: not a number") from None
        if not math.isfinite(f):
            raise RewardError(f"reward '{reward.name}' returned {f} for completion {i} {_sample(texts, i)}: rewards must be finite")
        out.append(f)
    return out


async def _awaited(awaitable):
    return await awaitable


def call_rewards(rewards: list[BoundReward], texts: list[str], kwargs: dict[str, list]) -> dict[str, list[float | None]]:
    """Every reward over the same completions, all at once (one thread each, so a slow judge
    or sandbox doesn't hold up the rest). A call past its timeout_s gives None for that step
    (excluded, not 0), a warning and a count in TIMEOUTS; the thread is left to finish."""
    if len(rewards) == 1 and rewards[0].timeout_s is None:
        return {rewards[0].name: call_reward(rewards[0], texts, kwargs)}
    pool = ThreadPoolExecutor(max_workers=len(rewards), thread_name_prefix="plait-reward")
    try:
        futures = {r.name: pool.submit(call_reward, r, texts, kwargs) for r in rewards}
        out = {}
        for r in rewards:
            try:
                out[r.name] = futures[r.name].result(timeout=r.timeout_s)
            except FutureTimeout:
                TIMEOUTS[r.name] += 1
                log.warning("reward '%s' took longer than %ss on %d completions: scored None (excluded) this step",
                            r.name, r.timeout_s, len(texts))
                out[r.name] = [None] * len(texts)
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def score_groups(groups: list[Group], rewards: list[BoundReward]) -> None:
    """Fill each group's per-reward scores and weighted total in place.

    None means "not applicable": it adds nothing to the total (and is left out of that
    reward's logged mean).
    """
    texts, kwargs = reward_inputs(groups)
    per_reward = call_rewards(rewards, texts, kwargs)
    i = 0
    for g in groups:
        n = len(g.completions)
        g.rewards = {name: vals[i : i + n] for name, vals in per_reward.items()}
        g.total = [
            sum(r.weight * g.rewards[r.name][j] for r in rewards if g.rewards[r.name][j] is not None) for j in range(n)
        ]
        i += n
