"""Statistics declared as fields with their rules (plait.algo.stats): how Sums adds them over
micro-batches and reduces them over processes into metrics, and that the update's own
statistics classes name denominators that exist and metrics that don't collide."""

from dataclasses import dataclass, fields
from typing import ClassVar

import pytest
import torch

from plait.algo.losses import LossOutputs
from plait.algo.stats import Sums, stat
from plait.train import update


@dataclass(kw_only=True)
class Tokens:
    loss: torch.Tensor = stat("loss", per="steps")
    hits: torch.Tensor = stat("hit/share", per="tokens")
    misses: torch.Tensor = stat("miss/share", per="tokens")
    tokens: float = stat()
    capped: torch.Tensor | None = stat("capped", per="tokens", optional=True)
    DERIVED: ClassVar[dict[str, tuple[str, ...]]] = {"hit_or_miss": ("hit/share", "miss/share")}


@dataclass(kw_only=True)
class Steps:
    steps: float = stat(across="same")
    local: float = stat("local", across="own")


def test_sums_add_in_order_and_log_by_rule():
    sums = Sums()
    for hits in (1.0, 2.0):
        sums.add(Tokens(loss=torch.tensor(0.5), hits=torch.tensor(hits), misses=torch.tensor(1.0), tokens=4.0), None)
        sums.add(Steps(steps=1.0, local=3.0))
    assert sums.metrics() == {
        "loss": 1.0 / 2,
        "hit/share": 3.0 / 8,
        "miss/share": 2.0 / 8,
        "local": 6.0,
        "hit_or_miss": 3.0 / 8 + 2.0 / 8,
    }  # `capped` was never measured: not logged


def test_only_per_process_statistics_are_summed_over_processes():
    sums = Sums()
    sums.add(Tokens(loss=torch.tensor(1.0), hits=torch.tensor(1.0), misses=torch.tensor(0.0), tokens=2.0))
    sums.add(Steps(steps=1.0, local=5.0))
    seen = []

    def two_processes(values):  # both processes hold the same numbers
        seen.append(len(values))
        return [2 * v for v in values]

    m = sums.metrics(two_processes)
    assert seen == [4]  # loss, hits, misses, tokens: one collective
    assert m["loss"] == 2.0 and m["hit/share"] == 2.0 / 4 and m["local"] == 5.0


def test_a_name_with_two_rules_is_an_error():
    @dataclass(kw_only=True)
    class Other:
        tokens: float = stat("tokens")

    sums = Sums()
    sums.add(Tokens(loss=torch.tensor(1.0), hits=torch.tensor(1.0), misses=torch.tensor(0.0), tokens=2.0))
    with pytest.raises(ValueError, match="tokens"):
        sums.add(Other(tokens=1.0))


def test_the_update_statistics_are_consistent():
    """Every statistic of the update has one name and one metric, and every denominator it names
    is a statistic of the update."""
    classes = [
        LossOutputs,
        update.MicroBatchStats,
        update.EngineMismatch,
        update.FirstUpdate,
        update.ChunkStats,
        update.StepStats,
    ]
    rules = [(f.name, f.metadata["rule"]) for c in classes for f in fields(c)]
    names = [name for name, _ in rules]
    metrics = [r.metric for _, r in rules if r.metric] + list(LossOutputs.DERIVED)
    assert len(set(names)) == len(names) and len(set(metrics)) == len(metrics)
    assert {r.per for _, r in rules if r.per} <= set(names)
