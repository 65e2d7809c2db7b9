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


MASKED = """
import torch


def masked(x, start: int, end: int):  # vLLM's vocabulary-parallel embedding mask, in short
    keep = (x >= start) & (x < end)
    return keep * (x - start * keep), ~keep


def right() -> bool:
    x = torch.arange(64, dtype=torch.int32) % 7
    return torch.equal(torch.compile(masked, dynamic=True)(x, 0, 24576)[0], x.long())
"""
PLAIT_START = "from plait.train.determinism import separate_kernel_cache\nseparate_kernel_cache()\n"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 instruction-set cap")
def test_a_capped_process_compiles_its_kernels_apart_from_the_native_ones(tmp_path):
    """torch inductor's graph cache does not key on ATEN_CPU_CAPABILITY: a graph compiled with the
    machine's kernels (AVX-512) and loaded under the AVX2 cap (the deterministic mode, the suite's
    AVX2 pass) was rebuilt with 8-wide vectors in loops stepping by 16, half its output garbage
    (a Zen 4, torch 2.13: vLLM's tensor-parallel embedding then read past its table, and a TP-2
    rollout server died at its first request). A process compiles the graph into a fresh default
    cache, then a capped one started as `plait` starts (which gives it a cache of its own) compiles
    the same graph, and its kernel computes what eager torch does. (The same two without plait's
    start: the capped one printed False on that Zen 4.)"""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("torch inductor needs a C++ compiler")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)  # where inductor's default cache lives: empty here
    for cap in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        done = subprocess.run(
            [sys.executable, "-c", PLAIT_START + MASKED + "print(right())"],
            env={**env, **cap},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.stdout.strip() == "True", (cap, done.stdout[-1000:] + done.stderr[-3000:])
    caches = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("torchinductor_"))
    assert len(caches) == 2 and caches[1] == caches[0] + "_avx2", caches
