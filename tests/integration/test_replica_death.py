"""A rollout replica whose engine dies is never half dead (rollout/server.py): every request
then gets a 503 naming the cause, the replica stops by itself (its process exits with code 1,
so a supervisor restarts it), and the trainer stops with one message naming the replica, the
cause and the resume advice.

Here the engine is the real HF engine on a tiny model, served in this process so that a fault
can be put into it: a forward hook that raises from a given decoding step on, as a device error
or an out-of-memory would. The same for vLLM's engine-core process, killed for real, is in
test_vllm.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient

from plait.auth import ENV, bearer, new_token
from plait.comm import free_port
from plait.config import load_config
from plait.models import load_model, load_tokenizer
from plait.rollout import make_engine
from plait.rollout import replica as replica_process
from plait.rollout.hf_process import HFReplica, generation_spec
from plait.rollout.remote import RolloutServerError
from plait.rollout.server import build_app, serve
from plait.types import Prompt, SamplingParams


pytestmark = pytest.mark.slow


class Fault:
    """A forward pre-hook that lets `healthy` forward passes through, then raises on every one."""

    def __init__(self, healthy: int):
        self.healthy = healthy

    def __call__(self, module, args):
        if self.healthy == 0:
            raise RuntimeError("injected device fault")
        self.healthy -= 1


def hf_replica(model) -> HFReplica:
    cfg = load_config(None, [f"model.name_or_path={model}", "train.precision=fp32"])
    return HFReplica(generation_spec(cfg, torch.device("cpu")))


def body(max_tokens: int = 6) -> dict:
    sampling = dict(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, stop=[], seed=1)
    return dict(
        prompts=[dict(token_ids=[1, 2, 3], index=0, sampling=dict(n=2, max_tokens=max_tokens, seed=1))],
        params=sampling,
        n=2,
    )


def test_a_replica_whose_engine_died_answers_only_503(tiny_model_path):
    """The engine raises mid-decode (step 3 of 6): that request's answer is a 503 with the cause,
    and from then on so is every other answer, /health's included (without the token too, for a
    supervisor's probe), even though the model would run again: what it holds is unknown."""
    token, deaths = new_token(), []
    replica = hf_replica(tiny_model_path)
    auth = bearer(token)
    with TestClient(build_app(replica, 0, [free_port()], token, on_dead=deaths.append)) as client:
        assert client.post("/generate", json=body(), headers=auth).status_code == 200
        assert client.get("/health", headers=auth).json()["running"] == 0
        hook = replica.engine.model.register_forward_pre_hook(Fault(healthy=2))
        r = client.post("/generate", json=body(), headers=auth)
        assert r.status_code == 503, r.text
        assert "engine of replica 0 died" in r.json()["detail"] and "injected device fault" in r.json()["detail"]
        assert deaths == [deaths[0]] and "injected device fault" in deaths[0]  # reported once

        hook.remove()
        assert client.post("/generate", json=body(), headers=auth).status_code == 503
        health = client.get("/health", headers=auth)
        assert health.status_code == 503 and "injected device fault" in health.json()["detail"]
        probe = client.get("/health")
        assert probe.status_code == 503 and probe.json() == {"ok": False}  # nothing about the run
        join = dict(host="127.0.0.1", port=1, rank_offset=1, world=2, backend="gloo", timeout_s=5)
        assert client.post("/weights/join", json=join, headers=auth).status_code == 503
        assert len(deaths) == 1


def test_a_request_the_dying_engine_never_answers_still_gets_its_503(tiny_model_path):
    """vLLM can take a request in while its engine core dies and then never answer it. The
    replica answers every request in flight with a 503 as soon as it sees the engine dead, not
    when (or if) the engine answers. Here the HF engine's forward pass blocks, and the engine
    reports itself dead meanwhile, as vLLM's does once its engine-core process is gone."""
    token, deaths = new_token(), []
    replica = hf_replica(tiny_model_path)
    auth = bearer(token)
    inside, release = threading.Event(), threading.Event()

    def hang(module, args):
        inside.set()
        release.wait()

    with TestClient(build_app(replica, 0, [free_port()], token, on_dead=deaths.append)) as client:
        replica.engine.model.register_forward_pre_hook(hang)
        answer: dict = {}
        asking = threading.Thread(target=lambda: answer.update(r=client.post("/generate", json=body(), headers=auth)))
        asking.start()
        try:
            assert inside.wait(300), "the request never reached the engine"
            replica.failed = "EngineDeadError: the engine core died"
            asking.join(300)  # the bound only keeps a regression from hanging the suite
            assert not asking.is_alive(), "the request was not answered after the engine died"
        finally:
            release.set()
            asking.join()
        r = answer["r"]
        assert r.status_code == 503, r.text
        assert "engine of replica 0 died" in r.json()["detail"] and "the engine core died" in r.json()["detail"]
        assert deaths == [deaths[0]]


def test_a_request_refused_by_the_engine_does_not_kill_it(tiny_model_path):
    """A ValueError is the engine refusing one request (a 400): the replica serves on."""
    token, deaths = new_token(), []
    replica = hf_replica(tiny_model_path)
    auth = bearer(token)
    with TestClient(build_app(replica, 0, [free_port()], token, on_dead=deaths.append)) as client:

        def refuse(module, args):
            raise ValueError("a prompt this engine cannot take")

        hook = replica.engine.model.register_forward_pre_hook(refuse)
        r = client.post("/generate", json=body(), headers=auth)
        assert r.status_code == 400 and "cannot take" in r.json()["detail"]
        hook.remove()
        assert client.post("/generate", json=body(), headers=auth).status_code == 200
        assert client.get("/health", headers=auth).status_code == 200 and deaths == []


class ServedReplica:
    """A real HF replica served over HTTP by `serve` in a thread of this process (so a fault can
    be put into its engine), and a trainer's RemoteEngine talking to it."""

    def __init__(self, model, monkeypatch):
        self.token, port = new_token(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.replica = hf_replica(model)
        self.result: dict = {}
        self.thread = threading.Thread(
            target=lambda: self.result.update(cause=serve(self.replica, 0, "127.0.0.1", [port], self.token)),
            daemon=True,
        )
        self.thread.start()
        replica_process.wait_healthy([self.url], [], 300)
        monkeypatch.setenv(ENV, self.token)
        cfg = load_config(
            None,
            [
                f"model.name_or_path={model}",
                "train.precision=fp32",
                "rollout.engine=vllm",
                "rollout.vllm.mode=server",
                f"rollout.vllm.servers=[{self.url}]",
            ],
        )
        self.tok = load_tokenizer(model)
        self.remote = make_engine(cfg, load_model(model, "float32"), self.tok)
        self.prompts = [Prompt(i, "", self.tok(f"What is {i} plus 2?")["input_ids"]) for i in range(2)]
        self.params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)

    def generate(self):
        return self.remote.generate(self.prompts, self.params, n=2)


@pytest.fixture
def served(tiny_model_path, monkeypatch):
    s = ServedReplica(tiny_model_path, monkeypatch)
    with s.remote.weights_for_round(0):  # joins the weight group, sends the weights
        assert all(len(g) == 2 for g in s.generate())
    yield s
    s.remote.close()


def test_the_trainer_names_the_dead_replica_its_cause_and_the_resume_advice(served):
    """Over real HTTP: the replica's engine dies under the trainer's request. The trainer's
    error names the replica's URL, the cause it returned and resume=auto; the server stops by
    itself and reports the cause (serve_replica turns that into exit code 1)."""
    served.replica.engine.model.register_forward_pre_hook(Fault(healthy=3))
    with pytest.raises(RolloutServerError) as err:
        served.generate()
    message = str(err.value)
    assert served.url in message and "HTTP 503" in message, message
    assert "injected device fault" in message and "resume=auto" in message, message
    served.thread.join(timeout=120)  # uvicorn's shutdown is bounded; the bound only keeps a bug from hanging
    assert not served.thread.is_alive(), "the replica kept serving after its engine died"
    assert "injected device fault" in served.result["cause"]


def test_a_replica_that_refuses_an_update_stops_the_push_at_once(served):
    """A replica that will not take part in a weight broadcast (here: it refuses weights its model
    does not have; a replica killed before its side connects is the same) leaves the trainer's
    side of the broadcast waiting for the group's timeout (request_timeout_s, 600 s). Its failed
    update request stops the push instead, with its reason; 64 MB cannot hide in socket buffers."""
    assert served.remote.settings.request_timeout_s >= 600
    with pytest.raises(RolloutServerError, match="weights the model does not have"):
        served.remote.push_weights([("not.a.weight", torch.zeros(16 * 2**20))], 1)


def test_health_says_what_each_replica_holds_and_names_a_dead_one(served):
    """The engine interface's health(): a live replica's /health answer; once its engine died,
    RolloutServerError with the cause the replica gives."""
    health = served.remote.health()
    (answer,) = health["replicas"].values()
    assert health["version"] == 0 and answer["version"] == 0 and answer["running"] == 0
    served.replica.engine.model.register_forward_pre_hook(Fault(healthy=0))
    with pytest.raises(RolloutServerError):
        served.generate()
    with pytest.raises(RolloutServerError, match="injected device fault|unreachable"):
        served.remote.health()  # a 503 naming the cause, or no answer once the replica has exited


def test_a_weight_update_waits_for_the_running_generation(served):
    """No completion mixes two weight versions (a replica without in-flight updates): an update
    sent while a generation runs waits, with /health saying so, until every forward pass of
    that generation has run on the old weights; then it loads, and the replica reports the new
    version. The generation is held inside its third forward pass so the update surely comes
    while it runs."""
    model = served.replica.engine.model
    probe = next(p for n, p in model.named_parameters() if n.endswith("embed_tokens.weight"))
    seen, inside, release = [], threading.Event(), threading.Event()

    def watch(module, args):
        seen.append(probe.detach().sum().item())  # the weights this forward pass runs on
        if len(seen) == 3:
            inside.set()
            release.wait()

    hook = model.register_forward_pre_hook(watch)
    old = probe.detach().clone()
    new = [(n, p.detach() + 0.01) for n, p in model.named_parameters()]
    result: dict = {}
    generating = threading.Thread(target=lambda: result.update(groups=served.generate()))
    pushing = threading.Thread(target=lambda: result.update(pushed=served.remote.push_weights(new, 1)))
    generating.start()
    try:
        assert inside.wait(300), "the generation never ran"
        pushing.start()
        (answer,) = served.remote.health()["replicas"].values()
        while not answer["updating"]:  # the update request has come and waits at the gate
            assert pushing.is_alive(), result
            (answer,) = served.remote.health()["replicas"].values()
        assert answer["running"] == 1 and answer["version"] == 0
        assert torch.equal(probe.detach(), old)  # not loaded under the running generation
    finally:
        release.set()
        generating.join()
        pushing.join()
        hook.remove()
    assert len(seen) > 3 and len(set(seen)) == 1, seen  # every forward pass on the old weights
    assert all(c.weight_version == 0 for g in result["groups"] for c in g)
    assert torch.equal(probe.detach(), old + 0.01)
    (answer,) = served.remote.health()["replicas"].values()
    assert answer["version"] == 1 and not answer["updating"] and answer["running"] == 0
