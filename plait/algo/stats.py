"""Statistics as typed fields, each with the rule that reduces it and logs it.

A statistics dataclass (the loss's `LossOutputs`, the trainer's per micro-batch and per update
statistics) has one field per statistic, declared with `stat()`. `Sums` adds them up over
micro-batches and updates, in the order they come, and `Sums.metrics` reduces them over
processes and logs each as

    metric = sum / max(1, sum of `per`)       (no `per`: the sum itself)

A field left None was not measured (its option is off): it is neither summed nor logged. A
class's `DERIVED` (a ClassVar) names metrics that are sums of its other metrics.
Adding a statistic is one field, with its rule, in the class of the code that measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal

import torch


# over processes: "sum" (each process holds its part), "same" (every process holds the same
# number already) or "own" (this process's own number, logged as such)
Across = Literal["sum", "same", "own"]


@dataclass(frozen=True)
class Rule:
    metric: str | None  # the logged name; None: a denominator of other statistics only
    per: str | None  # the statistic (field name) it is a mean over; None: logged as the sum
    across: Across


def stat(metric: str | None = None, *, per: str | None = None, across: Across = "sum", optional: bool = False) -> Any:
    """A statistics field with its rule; `optional` ones default to None (not measured)."""
    rule = {"rule": Rule(metric, per, across)}
    return field(default=None, metadata=rule) if optional else field(metadata=rule)


class Sums:
    """Running sums of statistics by field name. Floats from 0, added one by one in the order
    they come: the order of float additions is part of a run's bits (train.deterministic)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.rules: dict[str, Rule] = {}
        self.derived: dict[str, tuple[str, ...]] = {}

    def add(self, *stats) -> None:
        """Add statistics objects (None: skipped); their tensors reach the host in one sync."""
        named = [(f, getattr(s, f.name)) for s in stats if s is not None for f in fields(s)]
        named = [(f, v) for f, v in named if v is not None]
        tensors = [v.detach() for _, v in named if isinstance(v, torch.Tensor)]
        host = iter(torch.stack(tensors).tolist() if tensors else [])
        for f, v in named:
            if self.rules.setdefault(f.name, f.metadata["rule"]) != f.metadata["rule"]:
                raise ValueError(f"two statistics named {f.name!r} with different rules")
            self.total[f.name] = self.total.get(f.name, 0.0) + (next(host) if isinstance(v, torch.Tensor) else v)
        for s in stats:
            self.derived.update(getattr(s, "DERIVED", {}))

    def metrics(self, all_sum: Callable[[list[float]], list[float]] = list) -> dict[str, float]:
        """The logged metrics: statistics `across="sum"` summed over processes by `all_sum`
        (one collective), then each metric by its rule, and the sums of metrics (`DERIVED`)."""
        shared = [name for name, rule in self.rules.items() if rule.across == "sum"]
        total = {**self.total, **dict(zip(shared, all_sum([self.total[name] for name in shared])))}
        out = {}
        for name, rule in self.rules.items():
            if rule.metric is not None:  # a denominator never added (a part of a round) counts 0
                out[rule.metric] = total[name] if rule.per is None else total[name] / max(1.0, total.get(rule.per, 0.0))
        for metric, (first, *rest) in self.derived.items():
            out[metric] = out[first]
            for part in rest:
                out[metric] += out[part]
        return out
