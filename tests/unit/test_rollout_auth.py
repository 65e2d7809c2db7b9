"""The rollout servers' token and request checks as pure functions, and where the token goes: the
app's verdict on it, the replica's command line and environment (the servers themselves are
tested with hostile clients in tests/integration/test_rollout_security.py)."""

import os
import stat

import pytest
import torch

from plait.auth import ENV, TokenError, bearer, new_token, resolve_token, token_matches
from plait.comm import free_port
from plait.config import load_config
from plait.rollout.api import ApiError, JoinRequest, Limits, UpdateRequest, check_join, check_update


def test_the_first_side_creates_a_private_token_file_and_the_other_reads_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    token, source = resolve_token()
    path = tmp_path / "plait" / "rollout-token"
    assert source == str(path) and len(token) >= 40
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert resolve_token() == (token, source)  # the other side: same token
    assert resolve_token(tmp_path / "other")[0] != token  # another file, another token
    monkeypatch.setenv(ENV, "from-the-environment")
    assert resolve_token() == ("from-the-environment", f"${ENV}")
    monkeypatch.delenv(ENV)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="empty"):
        resolve_token(tmp_path / "empty")


def test_only_the_exact_bearer_header_matches():
    assert token_matches(bearer("abc")["Authorization"], "abc")
    assert token_matches(b"Bearer abc", "abc")
    for bad in (None, "", "abc", "Bearer abcd", "Bearer ab", "bearer abc", "Basic abc", "Bearer abc "):
        assert not token_matches(bad, "abc"), bad


def test_a_join_names_only_the_caller_or_an_allowed_address():
    req = JoinRequest(host="10.0.0.5", port=29500, rank_offset=1, world=2, backend="gloo", timeout_s=60)
    assert check_join(req, "10.0.0.5", Limits(), 1) == "10.0.0.5"
    with pytest.raises(ApiError) as e:
        check_join(req, "10.0.0.9", Limits(), 1)
    assert e.value.status == 403 and "--weights-from 10.0.0.5" in e.value.message
    assert check_join(req, "10.0.0.9", Limits(join_from=("10.0.0.5",)), 1) == "10.0.0.5"
    with pytest.raises(ApiError) as e:
        check_join(req, "10.0.0.5", Limits(), 2)  # 2 workers don't fit a world of 2 from rank 1
    assert e.value.status == 400


@pytest.mark.parametrize(
    "metas, buckets, why",
    [
        ([["w", "load", [2]]], [[0]], "dtype"),
        ([["w", "float32", [-1]]], [[0]], "dtype"),
        ([["w", "float32", [2]], ["v", "float32", [2]]], [[0]], "exactly once"),
        ([["w", "float32", [2]]], [[0, 0]], "exactly once"),
        ([["w", "float32", [2]], ["v", "bfloat16", [2]]], [[0, 1]], "one dtype"),
    ],
)
def test_weight_updates_must_come_from_the_joiner_and_be_well_formed(metas, buckets, why):
    good = UpdateRequest(version=1, metas=[["w", "float32", [2]]], buckets=[[0]])
    check_update(good, "10.0.0.5", joined_by="10.0.0.5")
    with pytest.raises(ApiError) as e:
        check_update(good, "10.0.0.5", joined_by=None)
    assert e.value.status == 409
    with pytest.raises(ApiError) as e:
        check_update(good, "10.0.0.6", joined_by="10.0.0.5")
    assert e.value.status == 403
    with pytest.raises(ApiError) as e:
        check_update(UpdateRequest(version=1, metas=metas, buckets=buckets), "10.0.0.5", joined_by="10.0.0.5")
    assert e.value.status == 400 and why in e.value.message


class _IdleEngine:
    """What build_app needs of an engine to answer /health; it generates nothing."""

    inflight = False

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def failure(self) -> None:
        return None

    def describe(self) -> dict:
        return {"model": "idle"}

    def limits(self) -> tuple[int, int]:
        return 32, 100


def test_every_rollout_server_lets_a_request_in_on_what_compare_digest_says_alone(monkeypatch):
    """`plait rollout-server`, the HF generation process and the Ray launcher's replicas all serve
    build_app's app behind api.Guard. Its verdict on a token is hmac.compare_digest's (constant
    time) over the whole header: told yes, a wrong token passes; told no, the right one is
    refused. So no other comparison (an `==` that stops at the first differing byte) decides."""
    import hmac

    from fastapi.testclient import TestClient

    from plait.rollout.server import build_app

    token, wrong = new_token(), bearer(new_token())
    real, calls, forced = hmac.compare_digest, [], {}

    def compare_digest(a, b):
        calls.append((a, b))
        return forced["verdict"] if forced else real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    expected = f"Bearer {token}".encode()
    with TestClient(build_app(_IdleEngine(), 0, [free_port()], token)) as client:
        assert client.get("/health", headers=bearer(token)).json()["model"] == "idle"
        assert calls == [(expected, expected)]
        assert client.get("/health", headers=wrong).status_code == 401
        assert calls[-1] == (wrong["Authorization"].encode(), expected)
        forced["verdict"] = True
        assert client.get("/health", headers=wrong).json()["model"] == "idle"
        forced["verdict"] = False
        assert client.get("/health", headers=bearer(token)).status_code == 401
        assert client.post("/generate", json={}, headers=bearer(token)).status_code == 401
    assert len(calls) == 5  # one comparison per request that carried a header


def test_a_replica_gets_its_token_in_its_environment_never_on_its_command_line(monkeypatch, tiny_model_path):
    """The replica processes plait starts (the HF generation process of asynchronous runs; and
    through the same replica.start, `plait rollout-server`'s and the Ray launcher's), as the code
    builds their command line and environment: the token is in the environment alone."""
    from plait.rollout import hf_process
    from plait.rollout import replica as replica_process

    started = []

    class Popen:
        def __init__(self, args, env=None, **_):
            started.append((list(args), dict(env)))

    monkeypatch.setattr(replica_process.subprocess, "Popen", Popen)
    monkeypatch.setattr(replica_process, "wait_healthy", lambda *a, **k: None)
    token = new_token()
    cfg = load_config(None, [f"model.name_or_path={tiny_model_path}", "train.precision=fp32"])
    hf_process.start_generation_process(cfg, torch.device("cpu"), 1.0, token)
    replica_process.start(
        {"model": "m", "tensor_parallel_size": 1}, 1, "0.0.0.0", [8000, 8001], token, {}, {"max_n": 4}
    )
    assert len(started) == 2
    for args, env in started:
        assert "plait.rollout.server" in args and env[ENV] == token
        assert not [a for a in args if token in a], args


def test_the_replica_process_takes_the_token_out_of_its_environment(monkeypatch):
    """Read once, then removed: vLLM's engine and workers, and whatever they start, don't inherit it."""
    from plait.rollout import hf_process, server

    seen = {}
    monkeypatch.setenv(ENV, "the-run-s-token")
    monkeypatch.setattr(server.logging, "basicConfig", lambda **_: None)
    monkeypatch.setattr(hf_process, "HFReplica", lambda spec: "engine")

    def serve(engine, replica, host, ports, token, limits):
        seen.update(engine=engine, token=token, inherited=os.environ.get(ENV))

    monkeypatch.setattr(server, "serve", serve)
    server.serve_replica({"engine": "hf"}, 0, "127.0.0.1", [1])
    assert seen == {"engine": "engine", "token": "the-run-s-token", "inherited": None}


@pytest.mark.parametrize(
    "sequences, why",
    [
        ([{"token_ids": [1, 2, 3], "start": 3}], "start=3 leaves no token of its 3 to score"),
        ([{"token_ids": [1] * 50, "start": 1}], "50 tokens exceed the served model's length 40"),
        ([{"token_ids": [1, 2, 100], "start": 1}], "token ids must lie in [0, 100)"),
        ([{"token_ids": [1, 2], "start": 1}] * 9, "9 sequences in one request; this server takes at most 8"),
    ],
)
def test_a_scoring_request_is_bounded_by_the_model_and_the_server(sequences, why):
    """POST /logprobs (a distillation teacher's scores): each sequence within the served model's
    length and vocabulary, scoring at least one token, and no more sequences than the server takes."""
    from plait.rollout.api import LogprobsRequest, check_logprobs

    limits = Limits(max_sequences=8)
    check_logprobs(LogprobsRequest(sequences=[{"token_ids": [1, 2, 3], "start": 2}]), limits, 40, 100)
    with pytest.raises(ApiError) as err:
        check_logprobs(LogprobsRequest(sequences=sequences), limits, 40, 100)
    assert why in err.value.message
