"""The cluster planner (plait/cluster/placement.py) and `plait plan`: placements, batch
arithmetic, alternatives, --auto and the memory estimate. Pure functions, no Ray."""

from __future__ import annotations

import subprocess

import pytest
from commands import plait_here

from plait.cluster import placement as pl
from plait.config import load_config


SERVER = ["rollout.engine=vllm", "rollout.vllm.mode=server"]


def cfg_of(*sets: str):
    return load_config(None, list(sets))


def seed_28_4(prompts: int):
    """The seeds' case: 4 nodes x 8 GPUs, 4 of them generate (4 replicas x tp 1), 28 train."""
    return cfg_of(
        *SERVER,
        "cluster.generation_devices=4",
        "rollout.vllm.data_parallel_size=4",
        f"rollout.prompts_per_step={prompts}",
        "rollout.num_generations=8",
    )


def test_28_training_and_4_generation_gpus_are_placed_node_by_node():
    placed = pl.plan_cluster(seed_28_4(56), pl.uniform_nodes(4, 8))
    assert isinstance(placed, pl.Placement)
    assert len(placed.train) == 28 and len(placed.replicas) == 4 and placed.tensor_parallel == 1
    # trainers fill nodes in order, the replicas take the last node's last GPUs
    assert [(s.node, s.device) for s in placed.train[:9]] == [(0, d) for d in range(8)] + [(1, 0)]
    assert [(rep[0].node, rep[0].device) for rep in placed.replicas] == [(3, 4), (3, 5), (3, 6), (3, 7)]
    b = placed.batch
    assert (b.prompts_per_process, b.completions_per_process, b.completions_per_step) == (2, 16, 448)
    text = "\n".join(pl.render(placed, seed_28_4(56)))
    assert "placement: 28 train (ddp: whole weights on each of 28) + 4 generate (vLLM: 4 replicas x tp 1)" in text
    assert "node 0  GPU 0-7: train ranks 0-7" in text
    assert "node 3  GPU 0-3: train ranks 24-27; GPU 4-7: generation replicas 0-3" in text
    assert "each trainer: 2 prompt(s) = 16 completions" in text
    assert "the replicas' token: a fresh one per run" in text
    external = pl.plan_cluster(cfg_of("rollout.engine=vllm", "rollout.vllm.mode=server"), pl.uniform_nodes(1, 2))
    assert "the servers' token: $PLAIT_ROLLOUT_TOKEN, else ~/.cache/plait/rollout-token" in "\n".join(
        pl.render(external, cfg_of("rollout.engine=vllm", "rollout.vllm.mode=server"))
    )


def test_28_4_with_a_batch_that_does_not_divide_proposes_the_nearest_that_do():
    problems, alts = pl.plan_cluster(seed_28_4(64), pl.uniform_nodes(4, 8))
    assert any("64 prompts / 28 processes = 2.29 is not whole" in p for p in problems)
    assert alts[0].overrides == ("rollout.prompts_per_step=56",)  # the nearest: same split, 2 prompts each
    assert ("rollout.prompts_per_step=112",) in [a.overrides for a in alts]
    # every proposal really places
    for a in alts:
        fixed = cfg_of(
            *SERVER,
            "cluster.generation_devices=4",
            "rollout.vllm.data_parallel_size=4",
            "rollout.prompts_per_step=64",
            "rollout.num_generations=8",
            *a.overrides,
        )
        assert isinstance(pl.plan_cluster(fixed, pl.uniform_nodes(4, 8)), pl.Placement), a
    text = "\n".join(pl.render_failure(problems, alts))
    assert text.startswith("this config can't be placed:") and "--set rollout.prompts_per_step=56" in text


def test_3_trainers_against_8_generations_split_by_prompt_not_by_completion():
    """The seeds' "3 training GPUs vs num_generations 8": 24 completions split 3 ways is fine in
    TRL's arithmetic only when 8 | 3 x batch; plait splits whole groups, so prompts must divide by 3."""
    nodes = pl.uniform_nodes(1, 4)
    ok = pl.plan_cluster(
        cfg_of(*SERVER, "cluster.generation_devices=1", "rollout.num_generations=8", "rollout.prompts_per_step=6"),
        nodes,
    )
    assert isinstance(ok, pl.Placement) and len(ok.train) == 3 and ok.batch.completions_per_process == 16
    bad_sets = [*SERVER, "cluster.generation_devices=1", "rollout.num_generations=8", "rollout.prompts_per_step=8"]
    bad = cfg_of(*bad_sets)
    problems, alts = pl.plan_cluster(bad, nodes)
    assert any("8 prompts / 3 processes" in p for p in problems)
    assert any("No rollout.num_generations alone fixes it" in p for p in problems)
    got = [a.overrides for a in alts]
    assert ("rollout.prompts_per_step=6",) == got[0] and (
        "rollout.prompts_per_step=9",
    ) not in got  # 9 x 8 = 72 / 3 = 24: not micro 16
    assert ("cluster.generation_devices=2", "rollout.vllm.data_parallel_size=2") in got  # 2 + 2 keeps 8 prompts
    sets, why = pl.auto_split(bad, nodes)
    assert (
        sets == ["cluster.generation_devices=2", "rollout.vllm.data_parallel_size=2"] and "2 train + 2 generate" in why
    )
    assert isinstance(pl.plan_cluster(cfg_of(*bad_sets, *sets), nodes), pl.Placement)


def test_tensor_parallel_replicas_stay_inside_one_node():
    sets = [
        *SERVER,
        "rollout.vllm.tensor_parallel_size=4",
        "rollout.vllm.data_parallel_size=2",
        "cluster.generation_devices=8",
        "rollout.prompts_per_step=16",
    ]
    placed = pl.plan_cluster(cfg_of(*sets), pl.uniform_nodes(2, 8))
    assert isinstance(placed, pl.Placement)
    assert all(len({s.node for s in rep}) == 1 for rep in placed.replicas)
    assert [[s.device for s in rep] for rep in placed.replicas] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # node 1 generates
    assert {s.node for s in placed.train} == {0}
    problems, alts = pl.plan_cluster(
        cfg_of(
            *sets[:2],
            "rollout.vllm.tensor_parallel_size=8",
            "rollout.vllm.data_parallel_size=1",
            "cluster.generation_devices=8",
            "rollout.prompts_per_step=8",
        ),
        pl.uniform_nodes(4, 4),
    )
    assert any("tensor_parallel_size=8 devices on one node, but the largest node has 4" in p for p in problems)
    assert alts and all("tensor_parallel_size=8" not in " ".join(a.overrides) for a in alts)


def test_cluster_devices_limits_the_plan_and_too_many_is_an_error():
    problems, _ = pl.plan_cluster(cfg_of("cluster.devices=40"), pl.uniform_nodes(4, 8))
    assert problems == ["cluster.devices=40, but the cluster has 32 devices; use at most 32 (or null for all)"]
    placed = pl.plan_cluster(cfg_of("cluster.devices=12", "rollout.prompts_per_step=24"), pl.uniform_nodes(2, 8))
    assert len(placed.train) == 12 and [s.node for s in placed.train].count(1) == 4
    text = "\n".join(pl.render(placed, cfg_of("cluster.devices=12")))
    assert text.splitlines()[2].endswith("node 1  GPU 0-3: train ranks 8-11")


def test_auto_keeps_every_device_training_when_generation_is_colocated():
    sets, why = pl.auto_split(cfg_of("rollout.engine=vllm", "rollout.vllm.mode=colocate"), pl.uniform_nodes(2, 8))
    assert sets == [] and "every one of the 16 devices trains" in why
    # no server split divides 7 prompts: auto_batch rounds the batch instead
    sets, why = pl.auto_split(cfg_of(*SERVER, "rollout.prompts_per_step=7"), pl.uniform_nodes(1, 8))
    assert "train.auto_batch=true" in sets and "cluster.generation_devices=2" in sets


def test_memory_estimate_shards_with_the_backend():
    shape = pl.shape_from_count(7e9)
    assert 6.5e9 < shape.params <= 7e9 and shape.layers > 16
    cfg = cfg_of("model.dtype=bfloat16", "train.precision=bf16")
    ddp = pl.estimate_memory(cfg, shape, 8, 0, "ddp", 80)
    fsdp = pl.estimate_memory(cfg, shape, 8, 0, "fsdp2", 80)
    assert (
        ddp.train["weights"] == pytest.approx(7e9 * 2, rel=0.1) and ddp.train["optimizer"] == 2 * ddp.train["weights"]
    )
    assert fsdp.train["weights"] == pytest.approx(ddp.train["weights"] / 8)
    assert fsdp.train["activations"] == ddp.train["activations"]  # activations are per process either way
    assert not ddp.fits and fsdp.train_total < ddp.train_total
    zero2 = pl.estimate_memory(
        cfg_of("model.dtype=bfloat16", "train.precision=bf16", "train.deepspeed.zero_stage=2"),
        shape,
        8,
        0,
        "deepspeed",
        80,
    )
    assert zero2.train["weights"] == ddp.train["weights"] and zero2.train["optimizer"] == pytest.approx(
        ddp.train["optimizer"] / 8
    )
    lora = pl.estimate_memory(
        cfg_of("model.dtype=bfloat16", "train.precision=bf16", "model.lora={r: 8}"), shape, 1, 0, "local", 80
    )
    assert lora.train["optimizer"] < ddp.train["optimizer"] / 50
    ckpt = pl.estimate_memory(
        cfg_of("model.dtype=bfloat16", "train.precision=bf16", "model.gradient_checkpointing=true"),
        shape,
        8,
        0,
        "ddp",
        80,
    )
    assert ckpt.train["activations"] < ddp.train["activations"] / 10
    gen = pl.estimate_memory(
        cfg_of(*SERVER, "rollout.vllm.gpu_memory_utilization=0.9", "train.precision=bf16"), shape, 8, 2, "ddp", 80
    )
    assert gen.generation["weights"] == pytest.approx(
        shape.params * 2 / 2
    )  # bf16 engine, tp 2 and gen.generation["kv cache"] > 0
    lines = pl.render_memory(ddp, "ddp", 8, 0)
    assert "** more than the device holds **" in lines[1] and "to fit:" in lines[-1]


def test_model_shape_counts_the_real_model_on_the_meta_device(tiny_model_path):
    shape = pl.model_shape(str(tiny_model_path))
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layers == model.config.num_hidden_layers and shape.hidden == model.config.hidden_size
    assert pl.model_shape("/nonexistent/model") is None


def test_the_plan_places_the_teacher_and_counts_its_weights_where_they_are_held(tiny_model_path, teacher_model_path):
    """A held teacher adds its own weights (its own parameter count, its dtype) to every training
    process, sharded as the reference is; in its own process or on a server it adds nothing there.
    The placement says where it runs."""
    shape = pl.shape_from_count(7e9)
    teacher = pl.model_shape(str(teacher_model_path)).params
    held = cfg_of(f"teacher.name_or_path={teacher_model_path}")
    assert pl.estimate_memory(held, shape, 8, 0, "ddp", 80).train["teacher"] == teacher * 4
    assert pl.estimate_memory(held, shape, 8, 0, "fsdp2", 80).train["teacher"] == pytest.approx(teacher * 4 / 8)
    bf16 = cfg_of(f"teacher.name_or_path={teacher_model_path}", "teacher.dtype=bfloat16")
    assert pl.estimate_memory(bf16, shape, 8, 0, "ddp", 80).train["teacher"] == teacher * 2
    own = cfg_of(f"teacher.name_or_path={teacher_model_path}", "teacher.site=process")
    assert "teacher" not in pl.estimate_memory(own, shape, 8, 0, "ddp", 80).train
    assert pl.teacher_line(own) == f"teacher: {teacher_model_path}, in its own process started by the trainer"
    served = cfg_of(f"teacher.name_or_path={teacher_model_path}", "teacher.site=server", "teacher.url=http://h:8000")
    assert pl.teacher_line(served) == "teacher: the rollout server at http://h:8000"
    assert pl.teacher_line(cfg_of()) is None


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return plait_here("plan", *args)


def test_plait_plan_prints_the_placement_and_exits_2_when_it_cannot():
    sets = sum(
        (
            ["--set", s]
            for s in [
                *SERVER,
                "cluster.generation_devices=4",
                "rollout.vllm.data_parallel_size=4",
                "rollout.num_generations=8",
            ]
        ),
        [],
    )
    ok = run_plan(
        "--nodes", "4", "--gpus-per-node", "8", *sets, "--set", "rollout.prompts_per_step=56", "--params", "7B"
    )
    assert ok.returncode == 0, ok.stderr
    assert "cluster: 4 node(s), 32 GPU device(s)" in ok.stdout and "GPU 4-7: generation replicas 0-3" in ok.stdout
    assert "memory per device (rough estimate; model 7.00B parameters, 80 GiB devices)" in ok.stdout
    bad = run_plan("--nodes", "4", "--gpus-per-node", "8", *sets, "--set", "rollout.prompts_per_step=64")
    assert bad.returncode == 2 and "placements that work (nearest first):" in bad.stdout
    auto = run_plan("--nodes", "4", "--gpus-per-node", "8", *sets, "--set", "rollout.prompts_per_step=64", "--auto")
    assert auto.returncode == 0 and auto.stdout.count("--auto: ") == 1, auto.stdout
    assert run_plan("--params", "seven").returncode != 0
