"""`plait diff` on real runs: two runs of one config on one machine agree bit for bit (metrics
and checkpoint weights); a one-ulp change injected into one run's record of a round is found at
that round and in the stage the metric belongs to; so is a one-ulp change in a weight."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch
from commands import plait_here
from safetensors.torch import load_file, save_file
from test_train import tiny_overrides

from plait.config import load_config
from plait.diff import diff_runs
from plait.train.loop import train


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_runs(tiny_model_path, prompts_jsonl, tmp_path_factory):
    """The same config run twice (3 rounds, a checkpoint after each)."""
    root = tmp_path_factory.mktemp("diff")
    runs = []
    for name in ("a", "b"):
        out = root / name
        train(
            load_config(
                None,
                tiny_overrides(
                    tiny_model_path,
                    prompts_jsonl,
                    out,
                    "train.max_steps=3",
                    "checkpoint.save_steps=1",
                    "checkpoint.keep_last=3",
                ),
            )
        )
        runs.append(out)
    return runs


def plait_diff(a, b) -> subprocess.CompletedProcess:
    return plait_here("diff", str(a), str(b))


def test_two_runs_of_one_config_agree_bit_for_bit(two_runs):
    """Same machine, same config and seed: every metric but speed and memory, and the weights
    of every checkpoint, are equal (the runs' processes are the same kernels on the same shapes)."""
    parting = diff_runs(*two_runs)
    assert parting.rounds_compared == 3 and parting.round is None
    assert parting.weights == [(1, True), (2, True), (3, True)]
    assert (parting.hashes.completions_compared, parting.hashes.completions_part) == (3, None)
    shown = plait_diff(*two_runs)
    assert shown.returncode == 0 and "agree on all 3 rounds" in shown.stdout, shown.stdout + shown.stderr
    assert "sampled completions (token ids, whatever the process count): the same in all 3 rounds" in shown.stdout


def one_ulp_later(x: float) -> float:
    return math.nextafter(x, math.inf)


@pytest.mark.parametrize(
    "metric, stage",
    [
        ("completion/length_mean", "generation"),
        ("reward/total/mean", "scoring"),
        ("loss", "loss"),
        ("grad_norm", "optimizer"),
    ],
)
def test_a_one_ulp_change_is_found_at_its_round_and_stage(two_runs, tmp_path, metric, stage):
    a, b = two_runs
    changed = tmp_path / "b"
    shutil.copytree(b, changed)
    rows = [json.loads(line) for line in (changed / "metrics.jsonl").read_text().splitlines()]
    rows[1][metric] = one_ulp_later(float(rows[1][metric]))  # round 2
    (changed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parting = diff_runs(a, changed)
    assert parting.round == 2 and parting.stage == stage and set(parting.differing) == {metric}
    shown = plait_diff(a, changed)
    assert shown.returncode == 1 and f"part at round 2, first in its {stage} stage" in shown.stdout, shown.stdout


def test_a_one_ulp_change_in_a_weight_is_found(two_runs, tmp_path):
    a, b = two_runs
    changed = tmp_path / "b"
    shutil.copytree(b, changed)
    f = changed / "checkpoints" / "step_00000002" / "model.safetensors"
    weights = load_file(str(f))
    name = sorted(weights)[0]
    flat = weights[name].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, dtype=flat.dtype))
    save_file(weights, str(f))
    assert diff_runs(a, changed).weights == [(1, True), (2, False), (3, True)]
    assert "differ at round(s) [2]" in plait_diff(a, changed).stdout


def test_a_folder_without_metrics_is_a_clear_error(two_runs, tmp_path):
    shown = plait_diff(two_runs[0], tmp_path)
    assert shown.returncode == 2 and "no metrics.jsonl" in shown.stderr


def test_metrics_only_one_run_logged_are_named_not_compared(two_runs, tmp_path):
    """Runs of two plait versions: a metric one of them does not log is no difference."""
    a, b = two_runs
    changed = tmp_path / "b"
    shutil.copytree(b, changed)
    rows = [json.loads(line) for line in (changed / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row["a/new_metric"] = 1.0
    (changed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parting = diff_runs(a, changed)
    assert parting.round is None and parting.unshared == {"A": [], "B": ["a/new_metric"]}
    assert "only run B logged (not compared): a/new_metric" in plait_diff(a, changed).stdout


def test_times_are_not_compared_and_everything_else_is():
    from plait.diff import compared

    timed = ["time/generate", "reward/accuracy/seconds", "tools/call_seconds", "comm/seconds", "mfu/step"]
    assert not any(compared(k) for k in timed)
    counted = ["tools/calls_per_completion", "grad_norm", "reward/accuracy/mean", "agent/calls", "logprob_gap"]
    assert all(compared(k) for k in counted)
