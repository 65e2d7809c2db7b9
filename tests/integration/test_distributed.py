"""Real torchrun jobs (gloo, 2 processes on this CPU) with each training backend.

The same seed must give the same run as one process: each process samples its share of the
prompts with per-group random streams, advantages see every process's rewards, and the loss
is normalized over the whole step. Not bitwise (the gradient sum is reduced in another order
than one process accumulates it), so weights are compared within WEIGHT_ATOL; every step's
completions must be the same token for token (hashes.jsonl's `completions` record, which does
not depend on the process count) and so must its rewards.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train import sampled, tiny_overrides

from plait.checkpoint import latest_checkpoint
from plait.comm import free_port
from plait.config import load_config
from plait.train.export import model_folder
from plait.train.loop import train


pytestmark = pytest.mark.slow

WEIGHT_ATOL = 2e-5  # measured: ddp/fsdp2 1.3e-6, deepspeed 7.9e-7 after 3 steps at lr 1e-3
# with a distillation teacher (its advantage on every token of every row), ZeRO-3 vs one process:
# 4.3e-5 on 3 of 49152 embedding rows (Zen 3), weights that moved 2.5e-3: the tied head gives every
# row a gradient, and Adam turns a rounding-sized one on a token nobody sampled into a visible step
TEACHER_WEIGHT_ATOL = 2e-4
BACKENDS = {
    "ddp": ["train.backend=ddp"],
    "fsdp2": ["train.backend=fsdp2"],
    "zero3": ["train.backend=deepspeed", "train.deepspeed.zero_stage=3"],
    "zero2": ["train.backend=deepspeed", "train.deepspeed.zero_stage=2"],
}


def _options(model, data, out, *extra):
    """test_train's tiny run, made 3 steps of 4 prompts with 4 micro-batches per process."""
    return tiny_overrides(
        model,
        data,
        out,
        "rollout.prompts_per_step=4",
        "train.micro_batch_size=2",
        "train.max_steps=3",
        "rewards=[{name: 'plait_test_rewards:vowel_share_crash_env'}]",
        "eval.after=true",
        "log.console=plain",
        *extra,
    )


def _torchrun(options, env, nproc=2, launcher=None, timeout=600):
    launcher = launcher or [
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "-m",
        "plait",
        "train",
        *sum((["--set", o] for o in options), []),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _two_nodes(options, env, timeout=600) -> subprocess.CompletedProcess:
    """Two torchrun invocations (--nnodes 2, one process each) meeting at a local rendezvous, as
    two machines' would: one job of 2 processes. Exit code 0 when both ended well, else the first
    failure's; their outputs joined."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        launcher = ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", port, "-m", "plait", "train", *sum((["--set", o] for o in options), [])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=timeout) for p in procs]
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(["torchrun x 2 nodes"], code, *("".join(o[i] for o in outs) for i in (0, 1)))


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(run, reference, atol=WEIGHT_ATOL):
    """The same completions (token ids), rewards, losses and grad norms per step, and the same
    final weights."""
    got, want = _metrics(run), _metrics(reference)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3]
    assert sampled(run, (1, 2, 3)) == sampled(reference, (1, 2, 3))
    for g, w in zip(got, want):
        assert g["reward/total/mean"] == pytest.approx(w["reward/total/mean"], rel=1e-6), g["step"]
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-6)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
        assert g["lr"] == pytest.approx(w["lr"])
    a = load_file(str(run / "final" / "model.safetensors"))
    b = load_file(str(reference / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    start = load_file(str(reference.parent / "start.safetensors"))
    changed = max((b[k] - start[k]).abs().max().item() for k in b)
    assert changed > max(100 * WEIGHT_ATOL, 10 * atol)  # training moved the weights far more than the tolerance
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), k


@pytest.fixture(scope="module")
def single_process_run(tiny_model_path, prompts_jsonl, tmp_path_factory):
    """The reference: the same config trained in one process, no torchrun."""
    root = tmp_path_factory.mktemp("single")
    shutil.copy(tiny_model_path / "model.safetensors", root / "start.safetensors")
    out = root / "run"
    train(load_config(None, _options(tiny_model_path, prompts_jsonl, out)))
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_processes_match_one_and_resume_after_a_crash(
    backend, single_process_run, tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """2 processes with gradient accumulation (4 micro-batches each): rank 1 crashes in step
    3, torchrun stops the job, the committed checkpoints of steps 1-2 resume it, and the
    finished run equals the same backend's unbroken 2-process run bit for bit (the same hashes of
    every stage in every round, torch.equal weights) and the single-process one within
    WEIGHT_ATOL. Its last checkpoint exports as a model folder with final/'s weights. fsdp2's
    checkpoint of the crashed run also resumes in one process and gives the never-split run, and its
    unbroken run is two torchrun invocations (--nnodes 2) meeting at a local rendezvous: one job."""
    out = tmp_path / "run"
    opts = _options(
        tiny_model_path, prompts_jsonl, out, "checkpoint.save_steps=1", "checkpoint.keep_last=3", *BACKENDS[backend]
    )
    unbroken = tmp_path / "unbroken"
    # fsdp2's unbroken run is launched as two nodes of one process each (their job is the same 2 ranks)
    launch = _two_nodes if backend == "fsdp2" else _torchrun
    straight = launch([*opts, f"output_dir={unbroken}"], helper_env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    if backend == "fsdp2":  # the two nodes formed one job, and it matches the single-process run
        assert [p["rank"] for p in json.loads((unbroken / "cluster.json").read_text())] == [0, 1]
        assert_same_run(unbroken, single_process_run)
    crash_env = {**helper_env, "PLAIT_TEST_CRASH_CALL": "3", "PLAIT_TEST_CRASH_RANK": "1"}
    crashed = _torchrun(opts, crash_env)
    assert crashed.returncode != 0 and "simulated crash" in crashed.stderr, crashed.stderr[-3000:]
    done = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert done == ["step_00000001", "step_00000002"], done  # no half-written checkpoint is visible
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["prompts_consumed_per_rank"] == [4, 4]
    if backend == "fsdp2":
        # DCP shards written by 2 processes load into 1 (a job that lost a node goes on), in this
        # process: the data position and weights carry over, and the run equals one never split
        alone = tmp_path / "alone"
        shutil.copytree(out, alone)
        resumed = train(load_config(None, [*(o.replace(str(out), str(alone)) for o in opts), "resume=auto"]))
        assert [m["reward/total/mean"] for m in resumed.history] == pytest.approx(
            [m["reward/total/mean"] for m in _metrics(single_process_run)][2:], rel=1e-6
        )
        assert_same_run(alone, single_process_run)

    resumed = _torchrun([*opts, "resume=auto"], helper_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert_same_run(out, single_process_run)
    assert (out / "hashes.jsonl").read_text() == (unbroken / "hashes.jsonl").read_text()
    same = ("loss", "grad_norm", "reward/total/mean", "logprob_gap", "entropy")
    assert [[m[k] for k in same] for m in _metrics(out)] == [[m[k] for k in same] for m in _metrics(unbroken)]
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (out, unbroken))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the last checkpoint, in this backend's own format, exports as a model folder holding final/'s weights
    c = load_file(f"{model_folder(str(latest_checkpoint(out)))}/model.safetensors")
    assert c.keys() == a.keys() and all(torch.equal(c[k], a[k]) for k in a)

    for m in _metrics(out):  # the telemetry of two processes: collectives timed, FLOPs of both counted
        assert m["comm/seconds"] > 0 and 0 < m["mfu/train"] < 2, m["step"]
    held = json.loads((out / "cluster.json").read_text())
    assert [p["rank"] for p in held] == [0, 1]
    total = held[0]["params_total"]
    for p in held:
        if backend in ("fsdp2", "zero3"):  # parameters sharded: about half each
            assert abs(p["params_local"] - total / 2) <= 0.01 * total, p
        else:  # ddp and ZeRO-2 keep whole parameters in every process
            assert p["params_local"] == total, p


@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
def test_one_process_under_torchrun(backend, single_process_run, tiny_model_path, prompts_jsonl, tmp_path, helper_env):
    """A sharded backend on one device under `torchrun --nproc_per_node 1` (FSDP2 or ZeRO-3 on
    one GPU, e.g. for offloading) joins torchrun's store and matches the plain run."""
    out = tmp_path / "run"
    done = _torchrun(_options(tiny_model_path, prompts_jsonl, out, *BACKENDS[backend]), helper_env, nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(out, single_process_run)


def test_a_config_problem_is_reported_once_and_stops_every_process(
    tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """3 prompts can't split into whole groups over 2 processes: exit 2 before any model loads,
    the message (printed by rank 0 only) gives values that work."""
    opts = _options(tiny_model_path, prompts_jsonl, tmp_path / "run", "rollout.prompts_per_step=3")
    res = _torchrun(opts, helper_env)
    assert res.returncode != 0
    assert res.stderr.count("3 prompts / 2 processes = 1.50 is not whole") == 1, res.stderr[-2000:]
    assert "rollout.prompts_per_step in [2, 4" in res.stderr
    assert not (tmp_path / "run").exists()


VARIANTS = {  # backend options, model/algorithm options that change what each backend must handle
    # REINFORCE++'s token advantages are whitened over both processes' tokens, with the KL of a
    # sharded reference model in the reward
    "fsdp2-reinforce-pp-kl-in-reward-checkpointing": (
        BACKENDS["fsdp2"],
        [
            "algo.beta=0.1",
            "algo.kl_in_reward=true",
            "algo.advantage_estimator=reinforce_pp_baseline",
            "model.gradient_checkpointing=true",
            "teacher.name_or_path={teacher}",
            "teacher.weight=0.5",
        ],
    ),
    # with a distillation teacher beside the reference, sharded the same way, naming its top k
    "zero3-kl-top-k-teacher-checkpointing": (
        BACKENDS["zero3"],
        ["algo.beta=0.1", "model.gradient_checkpointing=true", "teacher.name_or_path={teacher}"]
        + ["teacher.weight=0.5", "teacher.top_k=4"],
    ),
    # and a reasoning-gym mixture as the prompts, its verifier as a reward and eval metric
    "ddp-lora-environments": (
        BACKENDS["ddp"],
        [
            "model.lora={r: 4}",
            "data.path=null",
            "data.eval_path=null",
            "environments=[{type: reasoning_gym, dataset: basic_arithmetic, size: 40, eval_size: 4}, "
            "{type: reasoning_gym, dataset: leg_counting, size: 40, eval_size: 4, answer_format: boxed}]",
            "rewards=[{name: 'plait_test_rewards:vowel_share_crash_env'}, {name: environment}]",
        ],
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_model_checkpointing_and_lora_match_one_process(
    variant, tiny_model_path, teacher_model_path, prompts_jsonl, tmp_path, helper_env
):
    """A sharded reference model (KL in the loss, or in REINFORCE++'s token rewards) and a
    sharded distillation teacher, activation checkpointing, and LoRA under ddp train the same as
    in one process."""
    backend, extra = VARIANTS[variant]
    extra = [e.replace("{teacher}", str(teacher_model_path)) for e in extra]
    shutil.copy(tiny_model_path / "model.safetensors", tmp_path / "start.safetensors")
    single, run = tmp_path / "single", tmp_path / "run"
    train(load_config(None, _options(tiny_model_path, prompts_jsonl, single, *extra)))
    res = _torchrun(_options(tiny_model_path, prompts_jsonl, run, *extra, *backend), helper_env)
    assert res.returncode == 0, res.stderr[-3000:]
    if "algo.beta=0.1" in extra and "algo.kl_in_reward=true" not in extra:
        kl = [m["kl"] for m in _metrics(run)]
        assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-4  # the policy moved away from the reference
    teacher = any(e.startswith("teacher.") for e in extra)
    if teacher:  # the sharded teacher scores as the whole one
        for key in ("teacher/kl", "teacher/top_k_kl") if "teacher.top_k=4" in extra else ("teacher/kl",):
            got, want = ([m[key] for m in _metrics(d)] for d in (run, single))
            assert got == pytest.approx(want, abs=1e-5) and all(abs(k) > 1e-3 for k in want), key
    assert_same_run(run, single, TEACHER_WEIGHT_ATOL if teacher else WEIGHT_ATOL)


@pytest.mark.parametrize(
    "backend, extra",
    [
        (
            "fsdp2",
            [
                "algo.dynamic_sampling=true",
                "algo.max_sampling_rounds=3",
                "rewards=[{name: 'plait_test_rewards:sometimes_constant'}]",
            ],
        ),
        (
            "zero3",
            [
                "rollout.two_stage={first_generations: 2, keep: not_all_failed}",
                "algo.max_sampling_rounds=2",
                "rewards=[{name: 'plait_test_rewards:even_a'}, {name: 'plait_test_rewards:vowel_share'}]",
            ],
        ),
    ],
)
def test_processes_may_need_different_numbers_of_sampling_rounds(
    backend, extra, tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """Dynamic sampling and two-stage generation decide per process how many rounds to run;
    with sharded weights that must not leave one process waiting in a gather the other
    never joins (weights are gathered once per step, outside the rounds)."""
    out = tmp_path / "run"
    res = _torchrun(_options(tiny_model_path, prompts_jsonl, out, *BACKENDS[backend], *extra), helper_env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = _metrics(out)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert any(m["sampling/rounds"] > 1 for m in steps)  # the most any process needed
    if "two_stage" in extra[0]:
        assert sum(m["two_stage/prompts_skipped"] for m in steps) > 0
