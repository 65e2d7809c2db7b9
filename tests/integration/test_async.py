"""Asynchronous generation (rollout.max_staleness, docs/async.md) for real: the HF engine's
generation process, weights pushed over gloo, the producer thread, checkpoints holding the
rounds generated ahead.

How the tests know the generator really sampled from old weights: `logprob_gap` (mean |trainer
log-prob - engine log-prob| of the sampled tokens, both fp32) is ~1e-7 when the engine held the
weights the trainer trains at, and far larger after one update at learning rate 1e-3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from test_fault_tolerance import assert_every_relaunch_resumed_from_the_newest_commit
from test_train import final_weights, sampled, tiny_overrides
from test_vllm import metrics_of, train_cmd
from tool_model import made_once

from plait.config import load_config
from plait.diff import hashes_by_round
from plait.train.loop import train


pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
SYNCED_GAP = 1e-4  # engine and trainer on the same fp32 weights: ~1e-7


def async_overrides(model, data, out, *extra):
    return tiny_overrides(model, data, out, "rollout.max_staleness=1", "train.threads=1", *extra)


def test_async_rounds_are_generated_k_versions_behind_and_runs_reproduce(tiny_model_path, prompts_jsonl, tmp_path):
    """k=1: round t is sampled with the weights after round max(0, t-2), so the staleness of
    rounds 1..4 is 0, 1, 1, 1; the logprob gap shows the engine really held those weights; the
    stale rows are corrected (engine_is_correction resolves to on); two runs give the same
    weights bit for bit, one pushing them through shared memory (the default), one through the
    gloo broadcast; the shared file is gone after the run."""
    runs = []
    for name, shared in (("a", True), ("b", False)):
        out = tmp_path / name
        sets = async_overrides(tiny_model_path, prompts_jsonl, out, f"rollout.shared_memory_weights={shared}")
        result = train(load_config(None, sets))
        runs.append(out)
        m = result.history
        assert all(x["weight_sync/shared_memory"] == float(shared) for x in m if x["async/weight_pushes"])
        assert not list(Path("/dev/shm").glob(f"plait-weights-{os.getpid()}-*"))
        assert [x["async/scheduled_version"] for x in m] == [0, 0, 1, 2]
        assert [x["rollout/weight_staleness"] for x in m] == [0, 1, 1, 1]
        assert [x["rollout/staleness_mean"] for x in m] == [0, 1, 1, 1]
        assert m[0]["logprob_gap"] < SYNCED_GAP < min(x["logprob_gap"] for x in m[1:])
        assert [x["async/weight_pushes"] for x in m] == [1, 0, 1, 1]  # versions 0, 1, 2; round 2 reuses 0
        assert all(x["weight_sync/gb"] > 0 for x in m if x["async/weight_pushes"])
        assert all(0 <= x["async/generator_idle_share"] <= 1 for x in m)
        assert all("time/wait_for_rollout" in x for x in m)
        saved = yaml.safe_load((out / "config.yaml").read_text())
        assert saved["algo"]["engine_is_correction"] is True
        assert not [p for p in psutil.Process().children(recursive=True) if "plait.rollout.server" in p.cmdline()]
    a, b = (final_weights(r) for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_async_checkpoint_resumes_synchronously_and_refuses_another_process_count(
    tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """k=1, a checkpoint after round 2: it holds round 3, sampled ahead with the weights after
    round 1. Resumed by 2 processes, it is refused before anything trains, naming both counts and
    the fix, and nothing in the run directory changes. Resumed synchronously (max_staleness=0),
    it trains the held round first: round 3's completions, rewards and advantages equal the
    unbroken async run's bit for bit (hashes), and round 4 is sampled with the weights it trains
    (staleness 0, the log-prob gap of synced weights); its checkpoint holds no rounds ahead."""
    unbroken, resumed = tmp_path / "async", tmp_path / "resumed"
    args = async_overrides(tiny_model_path, prompts_jsonl, unbroken, "checkpoint.save_steps=2")
    train(load_config(None, args))
    shutil.copytree(unbroken, resumed)
    for done in (resumed / "final", resumed / "checkpoints" / "step_00000004"):
        shutil.rmtree(done)
    assert (resumed / "checkpoints" / "step_00000002" / "rollouts.pt").is_file()
    before = {p: p.read_bytes() for p in resumed.rglob("*") if p.is_file()}

    moved = [a.replace(str(unbroken), str(resumed)) for a in args]
    proc = subprocess.run(
        train_cmd(2, [*moved, "resume=auto"]), env=helper_env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode != 0
    said = proc.stderr
    assert "generated ahead for 1 training process(es), but 2 were launched: resume it with 1" in said, said[-3000:]
    assert "rollout.max_staleness=0" in said
    after = {p: p.read_bytes() for p in resumed.rglob("*") if p.is_file()}
    assert sorted(str(p.relative_to(resumed)) for p in after if after[p] != before.get(p)) == []

    result = train(load_config(None, [*moved, "rollout.max_staleness=0", "resume=auto"]))
    m = result.history
    assert [x["step"] for x in metrics_of(resumed)] == [1, 2, 3, 4] and len(m) == 2  # rounds 3 and 4 ran
    assert m[0]["rollout/weight_staleness"] == 1  # the held round, sampled with the weights after round 1
    assert m[1]["logprob_gap"] < SYNCED_GAP < m[0]["logprob_gap"]
    a, b = hashes_by_round(unbroken)[3], hashes_by_round(resumed)[3]
    for record in ("generation", "scoring", "advantages", "completions"):
        assert a[record] == b[record], record
    last = json.loads((resumed / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert last["rollouts_ahead"] == []  # so any process count may resume it


def test_async_chaos_kills_at_every_moment_and_the_run_ends_bitwise_equal(tmp_path):
    """bench/chaos.py --async 1: SIGKILL the trainer at start-up, mid-step, right after logging a
    round no checkpoint holds yet and mid-save, and the generation process mid-run; each relaunch
    resumes (with the rounds generated ahead from the checkpoint), and weights, optimizer state
    and metrics equal an unbroken async run's. The shared-memory files of the killed trainers'
    generation processes are gone too (each process removes its own when its trainer dies)."""
    before = set(Path("/dev/shm").glob("plait-weights-*"))
    out = tmp_path / "chaos.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--async", "1", "--nproc", "1"]
        + ["--kills", "5", "--steps", "8", "--save-steps", "1", "--seed", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kills"] == {"startup": 1, "step": 1, "unsaved": 1, "save": 1, "generation": 1}, res.stdout[-2000:]
    assert report["resumes"] >= 3 and report["corrupt_loads"] == 0 and report["checkpoints_differing"] == 0
    assert report["max_weight_diff"] == 0.0 and report["optimizer_identical"] and report["metrics_differing"] == []
    assert report["steps_logged"] == list(range(1, 9))
    assert_every_relaunch_resumed_from_the_newest_commit(report)
    deadline = time.monotonic() + 120  # a generation process notices its trainer's death within a second or so
    while orphaned_weight_files(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not orphaned_weight_files(before)


def orphaned_weight_files(before: set) -> set:
    """Shared-memory weight files made since `before` whose trainer is dead (plait names them
    plait-weights-PID-..., plait.rollout.shared_weights_path). A live trainer's file is another run's,
    such as the other test worker's; a name without a pid is no trainer's (the unit tests' files)."""
    owner = re.compile(r"plait-weights-(\d+)-")
    return {
        f
        for f in set(Path("/dev/shm").glob("plait-weights-*")) - before
        if (m := owner.match(f.name)) and not psutil.pid_exists(int(m.group(1)))
    }


def test_a_dead_generation_process_stops_the_run_with_the_fix(tiny_model_path, prompts_jsonl, tmp_path, helper_env):
    """The generation process is killed once round 2's checkpoint is committed (it holds round 3,
    generated ahead: a kill before round 3 exists leaves no checkpoint of round 2): the trainer
    stops (exit 2) naming the process and resume=auto, the checkpoint stays; resume=auto finishes."""
    out = tmp_path / "run"
    args = async_overrides(
        tiny_model_path, prompts_jsonl, out, "train.max_steps=40", "checkpoint.save_steps=2", "log.console=plain"
    )
    proc = subprocess.Popen(
        train_cmd(1, args), env=helper_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    committed = out / "checkpoints" / "step_00000002" / "COMMITTED"
    while not committed.is_file():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    (gen,) = [c for c in psutil.Process(proc.pid).children() if "plait.rollout.server" in " ".join(c.cmdline())]
    gen.kill()
    shown = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2, shown[-3000:]
    assert "the HF generation process" in shown and "resume=auto" in shown, shown[-2000:]
    assert committed.is_file()
    # 40 rounds kept the first run going past the kill; the resume (in this process) need not run them all
    train(load_config(None, [*args, "train.max_steps=6", "resume=auto"]))
    assert [x["step"] for x in metrics_of(out)] == list(range(1, 7))


@pytest.mark.parametrize(
    "extra",
    [
        ["algo.dynamic_sampling=true", "rewards=[{name: 'plait_test_rewards:sometimes_constant'}]"],
        ["rollout.two_stage={first_generations: 2}", "rollout.num_generations=4"],
        ["rollout.precision=int8"],
        ["rollout.precision=bf16"],
    ],
    ids=["dynamic-sampling", "two-stage", "int8-rollouts", "bf16-rollouts"],
)
def test_async_with_dynamic_sampling_and_two_stage(tiny_model_path, prompts_jsonl, tmp_path, extra):
    result = train(load_config(None, async_overrides(tiny_model_path, prompts_jsonl, tmp_path / "run", *extra)))
    m = result.history
    assert [x["rollout/weight_staleness"] for x in m] == [0, 1, 1, 1]
    assert all(x["sampling/rounds"] >= 1 for x in m)
    if "algo.dynamic_sampling=true" in extra:
        assert any(x["sampling/rounds"] > 1 for x in m)  # refills happened inside the producer
    elif "rollout.precision=int8" in extra or "rollout.precision=bf16" in extra:
        # the generation process samples in int8 from the fp32 weights pushed to it (bf16: a bf16 model
        # given bf16 weights, its linears packed); the first round (sampled with the weights it is
        # trained from) shows the precision's own gap, near the fp32 policy
        assert 1e-4 < m[0]["logprob_gap"] < 0.05 and all(x["engine/kl"] > 0 for x in m)
    else:
        # every first-stage group was either completed (the round's 2 prompts) or skipped, and counted
        assert [x["sampling/generated_groups"] - x["two_stage/prompts_skipped"] for x in m] == [2] * len(m)


@pytest.fixture
def one_process_async_run(tiny_model_path, prompts_jsonl, tmp_path_factory) -> Path:
    """The one-process async run the two-process ones are held against, made once for the session
    (one thread: the same bits whichever worker makes it)."""

    def make(out: Path) -> Path:
        train(load_config(None, async_overrides(tiny_model_path, prompts_jsonl, out)))
        return out

    return made_once(tmp_path_factory, "async-one-process", make)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_async_under_torchrun_two_processes(
    tiny_model_path, prompts_jsonl, tmp_path, helper_env, backend, one_process_async_run
):
    """2 processes with k=1: rank 0's producer makes both processes' shares (fsdp2: the weights
    it pushes are gathered from both shards). Rounds 1 and 2 are sampled from the initial
    weights, so their completions (token for token) and rewards equal a one-process async run's. The same
    2-process run, crashed in rank 0's seventh reward call, round 4's (its producer scores each
    process's share, ahead of the trainer), and resumed with resume=auto, ends with the unbroken
    run's weights and every round's hashes, bit for bit."""
    one, two, crashed = one_process_async_run, tmp_path / "two", tmp_path / "crashed"
    crashing = ["rewards=[{name: 'plait_test_rewards:vowel_share_crash_env'}]", "checkpoint.save_steps=1"]
    args = async_overrides(tiny_model_path, prompts_jsonl, two, f"train.backend={backend}", *crashing)
    proc = subprocess.run(train_cmd(2, args), env=helper_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1, m2 = metrics_of(one), metrics_of(two)
    assert [x["rollout/weight_staleness"] for x in m2] == [0, 1, 1, 1]
    key = "reward/total/mean"
    assert [x[key] for x in m2[:2]] == [x[key] for x in m1[:2]]
    assert sampled(two, (1, 2)) == sampled(one, (1, 2))  # token for token

    args = async_overrides(tiny_model_path, prompts_jsonl, crashed, f"train.backend={backend}", *crashing)
    env = {**helper_env, "PLAIT_TEST_CRASH_CALL": "7", "PLAIT_TEST_CRASH_RANK": "0"}
    proc = subprocess.run(train_cmd(2, args), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0 and "simulated crash" in proc.stderr, proc.stderr[-3000:]
    assert not (crashed / "final").exists() and any((crashed / "checkpoints").glob("step_*/COMMITTED"))
    proc = subprocess.run(
        train_cmd(2, [*args, "resume=auto"]), env=helper_env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (crashed / "hashes.jsonl").read_text() == (two / "hashes.jsonl").read_text()
    a, b = final_weights(two), final_weights(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_inflight_updates_record_the_version_of_every_token(tiny_model_path, prompts_jsonl, tmp_path):
    """rollout.inflight_updates: weights are pushed as soon as they exist and swapped in between
    tokens; staleness stays within k, and samples list the versions that sampled them."""
    out = tmp_path / "run"
    result = train(
        load_config(
            None,
            async_overrides(
                tiny_model_path, prompts_jsonl, out, "rollout.inflight_updates=true", "log.sample_every_steps=1"
            ),
        )
    )
    m = result.history
    assert all(0 <= x["rollout/staleness_mean"] <= x["rollout/weight_staleness"] <= 1 for x in m)
    assert m[0]["rollout/weight_staleness"] == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["weight_versions"] and max(s["weight_versions"]) <= s["step"] - 1 for s in samples)
