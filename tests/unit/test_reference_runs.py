"""The deterministic reference runs kept in bench/reference/ were made on different CPU kinds;
they agree bit for bit (every compared metric, every round's five hashes) or this fails. A
new reference run added there from another CPU is checked against the others the same way."""

from itertools import combinations
from pathlib import Path

import pytest
import yaml

from plait.diff import diff_runs
from plait.train.hashes import STAGES


REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "reference" / "deterministic-demo-3-rounds"
RUNS = sorted(p for p in REFERENCE.iterdir() if (p / "metrics.jsonl").is_file())


def test_there_are_reference_runs_from_at_least_two_cpus():
    assert len(RUNS) >= 2, RUNS


@pytest.mark.parametrize("a, b", list(combinations(RUNS, 2)), ids=lambda p: p.name)
def test_reference_runs_from_two_cpus_agree_bit_for_bit(a, b):
    for run in (a, b):  # the same deterministic config, threads written down
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["train"]["deterministic"] is True and cfg["train"]["threads"] == 2
    parting = diff_runs(a, b)
    assert parting.rounds_compared == 3 and parting.round is None, parting.differing
    assert parting.hashes is not None and parting.hashes.stages == list(STAGES)
    assert parting.hashes.rounds_compared == 3 and parting.hashes.round is None
