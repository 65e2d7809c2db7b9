"""The OpenAI-compatible endpoint agents call (`rollout.agent`, see agent.py): a FastAPI app on
uvicorn, in a thread of the process that generates, bound to rollout.agent.host (loopback by
default) and guarded by a fresh bearer token per run (never written down; agents get it in
their task).

    POST /rollouts/{key}/v1/chat/completions   OpenAI chat completions (one choice, no streaming)
    POST /rollouts/{key}/v1/completions        OpenAI completions (one prompt: text or token ids)
    GET  /rollouts/{key}/v1/models             the model name

`key` is the rollout's own (a fresh random one per rollout), so any OpenAI client pointed at a
rollout's base URL tags its calls with that rollout. Errors come back in OpenAI's shape,
{"error": {"message", "type", "code"}}, so clients raise them with the message.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time

from fastapi import FastAPI, Request  # at module level: the routes' annotations are resolved here
from fastapi.responses import JSONResponse

from plait.auth import new_token, token_matches


MODEL = "plait-policy"  # the model name /v1/models lists (any name is accepted)


class AgentRequestError(ValueError):
    """A request the endpoint refuses; `status` is its HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Endpoint:
    """Started on first use; `serve(round)` routes requests to that round's rollouts."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.token = new_token()
        self.round = None
        self._server = None
        self._thread: threading.Thread | None = None

    def new_key(self) -> str:
        return secrets.token_urlsafe(12)

    def base_url(self, key: str) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/rollouts/{key}/v1"

    def serve(self, round_) -> None:
        if round_ is not None:
            self.start()
        self.round = round_

    def start(self) -> None:
        if self._server is not None:
            return
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise OSError(
                f"rollout.agent: can't listen on {self.host}:{self.port} ({err.strerror}): choose another "
                "rollout.agent.port, or 0 for any free one"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="plait-agent-endpoint", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"rollout.agent: the endpoint on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def _app(self):
        app = FastAPI(title="plait agent endpoint")

        def error(status: int, message: str) -> JSONResponse:
            kind = "authentication_error" if status == 401 else "invalid_request_error"
            return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

        async def call(request: Request, key: str, kind: str):
            if not token_matches(request.headers.get("authorization"), self.token):
                return error(401, "missing or wrong API key: use the task's api_key")
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the body is not JSON")
            if not isinstance(body, dict):
                return error(400, "the body must be a JSON object")
            round_ = self.round
            if round_ is None:
                return error(409, "no round is being generated: a rollout's URL works while its agent runs")
            try:
                return await asyncio.wrap_future(round_.submit(key, kind, body))
            except AgentRequestError as err:
                return error(err.status, str(err))

        @app.post("/rollouts/{key}/v1/chat/completions")
        async def chat(request: Request, key: str):
            return await call(request, key, "chat")

        @app.post("/rollouts/{key}/v1/completions")
        async def completions(request: Request, key: str):
            return await call(request, key, "text")

        @app.get("/rollouts/{key}/v1/models")
        async def models(request: Request, key: str):
            if not token_matches(request.headers.get("authorization"), self.token):
                return error(401, "missing or wrong API key: use the task's api_key")
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "plait"}]}

        return app
