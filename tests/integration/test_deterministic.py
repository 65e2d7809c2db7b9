"""train.deterministic, end to end through `plait train` (the command restarts itself with the
kernels pinned): two processes give identical metrics and per-round hashes, every stage hashed;
`plait diff` finds a one-ulp change in one reward score at its round, in the scoring stage, where
the metrics cannot see it yet."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_train import tiny_overrides

from plait.diff import compared, diff_runs
from plait.train.hashes import STAGES


pytestmark = pytest.mark.slow


def plait_train(model, data, out, env, *extra) -> subprocess.CompletedProcess:
    sets = tiny_overrides(
        model,
        data,
        out,
        "train.max_steps=3",
        "train.deterministic=true",
        "rewards=[{name: 'plait_test_rewards:vowel_share_ulp_env'}]",
        "log.console=plain",
        *extra,
    )
    cmd = [sys.executable, "-m", "plait", "train", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def runs(tiny_model_path, prompts_jsonl, tmp_path_factory):
    """Two runs of one config; a third whose reward function adds one ulp to a score in round 2."""
    root = tmp_path_factory.mktemp("deterministic")
    helpers = str(Path(__file__).parents[1] / "helpers")  # the test reward module
    out = {}
    for name, ulp in (("a", None), ("b", None), ("ulp", "2")):
        env = {k: v for k, v in os.environ.items() if k != "PLAIT_TEST_ULP_CALL"}
        env["PYTHONPATH"] = os.pathsep.join([helpers, env.get("PYTHONPATH", "")])
        if ulp:
            env["PLAIT_TEST_ULP_CALL"] = ulp
        out[name] = (root / name, plait_train(tiny_model_path, prompts_jsonl, root / name, env))
    return out


def records(run_dir, name):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_two_processes_give_identical_metrics_and_hashes(runs):
    (a, shown), (b, _) = runs["a"], runs["b"]
    ma, mb = records(a, "metrics.jsonl"), records(b, "metrics.jsonl")
    assert len(ma) == len(mb) == 3
    for ra, rb in zip(ma, mb):
        assert {k: v for k, v in ra.items() if compared(k)} == {k: v for k, v in rb.items() if compared(k)}
    ha, hb = records(a, "hashes.jsonl"), records(b, "hashes.jsonl")
    assert ha == hb and [h["round"] for h in ha] == [1, 2, 3]
    assert all(isinstance(h[s], str) and len(h[s]) == 16 for h in ha for s in STAGES)  # every stage hashed
    assert len({h["optimizer"] for h in ha}) == 3  # the weights move every round: the hash sees it
    assert "deterministic: threads pinned to" in shown.stdout
    if platform.machine() == "x86_64":  # the restart set the caps before torch loaded
        assert "kernels pinned: ATen and oneDNN to their AVX2 code paths" in shown.stdout, shown.stdout[:3000]
        assert "rollout.packed_weights=false" in shown.stdout
        assert "not pinned" not in shown.stdout
    assert yaml.safe_load((a / "config.yaml").read_text())["train"]["threads"] >= 1  # written down for reruns


def test_diff_finds_a_one_ulp_reward_change_at_its_round_and_stage(runs):
    (a, _), (ulp, _) = runs["a"], runs["ulp"]
    parting = diff_runs(a, ulp)
    assert parting.hashes.round == 2 and parting.hashes.stage == "scoring", parting.hashes
    assert parting.hashes.stages == list(STAGES)
    shown = subprocess.run([sys.executable, "-m", "plait", "diff", str(a), str(ulp)], capture_output=True, text=True)
    assert shown.returncode == 1
    assert "hashes: the runs part at round 2, first in its scoring stage" in shown.stdout, shown.stdout
