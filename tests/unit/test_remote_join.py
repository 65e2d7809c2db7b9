"""The trainer's side of the weight join when a replica fails it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from plait.config import load_config
from plait.rollout.remote import RemoteEngine, RolloutServerError


class DyingReplica(BaseHTTPRequestHandler):
    """Healthy until asked to join; then it answers as a replica whose workers died."""

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        port = self.server.server_address[1]
        self._answer(200, dict(replicas=[port], instance="a", tensor_parallel_size=1, version=0, model="m"))

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(500, {"detail": "the replica's workers died"})

    def log_message(self, *args):
        pass


@pytest.fixture
def replica():
    server = ThreadingHTTPServer(("127.0.0.1", 0), DyingReplica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_failed_join_stops_the_push_instead_of_waiting_out_the_rendezvous(replica):
    """The join request fails while the trainer hosts the weight group's store: the push raises
    the replica's answer, not the store's timeout after request_timeout_s (600 s here)."""
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.mode=server", f"rollout.vllm.servers=[{replica}]"])
    assert cfg.rollout.vllm.request_timeout_s == 600
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    engine = RemoteEngine(cfg, tok, view=None, device=torch.device("cpu"), token="t")
    with pytest.raises(
        RolloutServerError, match=r"/weights/join \(HTTP 500\): the replica.s workers died.*resume=auto"
    ):
        engine.push_weights([("w", torch.zeros(4))], version=1)
