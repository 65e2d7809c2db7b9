"""What a rollout server accepts: the token, the size and shape of every request, and who may
make it join a weight group. Everything here runs before a request reaches the engine, so a
refused request changes nothing and costs the server little.

- `Guard` (ASGI middleware): 401 without the right token (every path but a bare /health), 413
  for a body over `Limits.max_body_mb`, 408 for a body that does not arrive within
  `Limits.body_timeout_s`; each refusal is logged with the caller's address (rate-limited).
- The request models: unknown fields, wrong types and out-of-range sampling parameters are a
  400 naming the field; `check_generate` adds the limits that depend on the served model
  (prompt length, token ids, n, max_tokens) and the server's own bounds.
- `check_join` / `check_update`: a replica dials only the address the join came from (or one
  the operator allowed), and takes weights only from the client that joined it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from plait.algo.names import MAX_TOP_K
from plait.auth import token_matches


log = logging.getLogger("plait.rollout.server")

DTYPES = {"float32", "bfloat16", "float16", "float64", "int8", "uint8", "int32", "int64", "float8_e4m3fn"}


@dataclass(frozen=True)
class Limits:
    max_body_mb: float = 64.0
    body_timeout_s: float = 30.0
    max_prompts: int = 4096  # prompts in one /generate
    max_n: int = 512  # completions per prompt
    max_sequences: int = 65536  # prompts x n in one /generate
    max_stop_strings: int = 32
    max_stop_chars: int = 1024
    join_from: tuple[str, ...] = ()  # addresses a join may name besides its own (--weights-from)


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class VllmSampling(_Strict):
    """vLLM's sampling arguments as plait's trainer sends them (sampling_dict); nothing else."""

    n: int = Field(1, ge=1)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stop: list[str] | None = None
    include_stop_str_in_output: bool = True
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(0, ge=0, le=20)


class HFSampling(_Strict):
    """plait's SamplingParams, which the HF generation process reads."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: list[str] = []
    seed: int = Field(0, ge=0, lt=2**63)


class PromptRequest(_Strict):
    token_ids: list[int] = Field(min_length=1)
    index: int = Field(0, ge=0, lt=2**63)
    sampling: VllmSampling


class GenerateRequest(_Strict):
    prompts: list[PromptRequest] = Field(min_length=1)
    params: HFSampling | None = None
    n: int | None = Field(None, ge=1)


class ScoredSequence(_Strict):
    """One sequence to score: the log-prob of token_ids[t] after token_ids[:t], for t >= start."""

    token_ids: list[int] = Field(min_length=2)
    start: int = Field(ge=1)


class LogprobsRequest(_Strict):
    sequences: list[ScoredSequence] = Field(min_length=1)
    temperature: float = Field(1.0, gt=0.0)
    # > 0: also the top_k likeliest tokens at each scored position (ids and log-probs)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)


class JoinRequest(_Strict):
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world: int = Field(ge=2, le=65536)
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(gt=0, le=86400)


class UpdateRequest(_Strict):
    version: int = Field(ge=0, lt=2**63)
    metas: list[tuple[str, str, list[int]]] = Field(min_length=1)
    buckets: list[list[int]] = Field(min_length=1)
    shared: bool = False  # the tensors are in the shared-memory file the replica was started with, not broadcast


def _stops(stop: list[str] | None, limits: Limits) -> None:
    stop = stop or []
    if len(stop) > limits.max_stop_strings or any(len(s) > limits.max_stop_chars or not s for s in stop):
        raise ApiError(
            400,
            f"stop: at most {limits.max_stop_strings} non-empty strings of at most {limits.max_stop_chars} characters",
        )


def check_generate(req: GenerateRequest, limits: Limits, max_model_len: int, vocab_size: int) -> None:
    """The bounds no schema can say: they depend on the served model and the server's limits."""
    if len(req.prompts) > limits.max_prompts:
        raise ApiError(
            413, f"{len(req.prompts)} prompts in one request; this server takes at most {limits.max_prompts}"
        )
    hf = req.params is not None
    total = 0
    for i, p in enumerate(req.prompts):
        n = (req.n or 1) if hf else p.sampling.n
        max_tokens = req.params.max_tokens if hf else p.sampling.max_tokens
        if n > limits.max_n:
            raise ApiError(400, f"prompts[{i}]: n={n}; this server samples at most {limits.max_n} per prompt")
        total += n
        if len(p.token_ids) + max_tokens > max_model_len:
            raise ApiError(
                400,
                f"prompts[{i}]: {len(p.token_ids)} prompt tokens + max_tokens={max_tokens} exceed the served "
                f"model's length {max_model_len}",
            )
        if min(p.token_ids) < 0 or max(p.token_ids) >= vocab_size:
            raise ApiError(400, f"prompts[{i}]: token ids must lie in [0, {vocab_size})")
        _stops(p.sampling.stop, limits)
    if hf:
        _stops(req.params.stop, limits)
    if total > limits.max_sequences:
        raise ApiError(413, f"{total} completions in one request; this server takes at most {limits.max_sequences}")


def check_logprobs(req: LogprobsRequest, limits: Limits, max_model_len: int, vocab_size: int) -> None:
    """A scoring request's bounds: as many sequences as a generation's completions, each within the
    served model's length and vocabulary, scoring at least its last token."""
    if len(req.sequences) > limits.max_sequences:
        raise ApiError(
            413, f"{len(req.sequences)} sequences in one request; this server takes at most {limits.max_sequences}"
        )
    for i, seq in enumerate(req.sequences):
        if seq.start >= len(seq.token_ids):
            raise ApiError(
                400, f"sequences[{i}]: start={seq.start} leaves no token of its {len(seq.token_ids)} to score"
            )
        if len(seq.token_ids) > max_model_len:
            raise ApiError(
                400, f"sequences[{i}]: {len(seq.token_ids)} tokens exceed the served model's length {max_model_len}"
            )
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab_size:
            raise ApiError(400, f"sequences[{i}]: token ids must lie in [0, {vocab_size})")


def check_join(req: JoinRequest, client: str, limits: Limits, tensor_parallel_size: int) -> str:
    """The address to dial: the caller's own, or one the operator allowed (--weights-from)."""
    if req.host != client and req.host not in limits.join_from:
        raise ApiError(
            403,
            f"a join from {client} may only name its own address, not {req.host} (a trainer behind NAT: start the "
            f"server with --weights-from {req.host})",
        )
    if req.rank_offset + tensor_parallel_size > req.world:
        raise ApiError(400, f"rank_offset {req.rank_offset} + this replica's {tensor_parallel_size} worker(s) > world")
    return req.host


def check_update(req: UpdateRequest, client: str, joined_by: str | None) -> None:
    if req.shared:
        pass  # no group: the file is one only the trainer that started this replica knows (the spec names it)
    elif joined_by is None:
        raise ApiError(409, "no weight group joined yet: POST /weights/join first")
    elif client != joined_by:
        raise ApiError(403, f"weights come only from the client that joined the weight group ({joined_by})")
    for name, dtype, shape in req.metas:
        if dtype not in DTYPES or any(d < 0 for d in shape) or not name:
            raise ApiError(400, f"metas: bad entry {[name, dtype, shape]} (dtype one of {sorted(DTYPES)})")
    flat = sorted(i for b in req.buckets for i in b)
    if flat != list(range(len(req.metas))):
        raise ApiError(400, "buckets: every tensor index exactly once")
    for b in req.buckets:
        if not b or len({req.metas[i][1] for i in b}) != 1:
            raise ApiError(400, "buckets: each one non-empty and of one dtype")


@dataclass
class _RefusalLog:
    """At most one log line per second; the lines in between are counted, not lost."""

    last: float = 0.0
    skipped: int = 0
    counts: dict[int, int] = field(default_factory=dict)

    def refused(self, status: int, client: str, method: str, path: str, why: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1
        now = time.monotonic()
        if now - self.last < 1.0:
            self.skipped += 1
            return
        more = f" ({self.skipped} more refused since the last line)" if self.skipped else ""
        log.warning("refused %s %s from %s: %d %s%s", method, path, client, status, why, more)
        self.last, self.skipped = now, 0


class Guard:
    """ASGI middleware in front of the app: token, body size, body time."""

    def __init__(self, app, token: str, limits: Limits):
        self.app, self.token, self.limits = app, token, limits
        self.refusals = _RefusalLog()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization")
        authorized = token_matches(auth, self.token)
        scope.setdefault("state", {})["authorized"] = authorized
        if not authorized and not (path == "/health" and auth is None and method == "GET"):
            why = "no token" if auth is None else "wrong token"
            return await self._refuse(send, 401, f"{why}: send Authorization: Bearer <the run's token>", scope)
        cap = int(self.limits.max_body_mb * 2**20)
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await self._refuse(send, 400, "bad Content-Length", scope)
        if declared > cap:
            return await self._refuse(send, 413, f"body of {declared} bytes; at most {cap}", scope)
        body, status = await self._read_body(receive, cap)
        if status == 413:
            return await self._refuse(send, 413, f"body over {cap} bytes", scope)
        if status == 408:
            return await self._refuse(send, 408, f"body not received within {self.limits.body_timeout_s:.0f} s", scope)
        if status == 499:  # the client went away
            return None
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect as usual

        return await self.app(scope, replay, send)

    async def _read_body(self, receive, cap: int) -> tuple[bytes, int]:
        chunks, size = [], 0
        deadline = time.monotonic() + self.limits.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", 408
            if msg["type"] == "http.disconnect":
                return b"", 499
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > cap:
                return b"", 413
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks), 200

    async def _refuse(self, send, status: int, why: str, scope) -> None:
        client = scope.get("client") or ("?", 0)
        self.refusals.refused(status, f"{client[0]}:{client[1]}", scope["method"], scope["path"], why)
        await json_response(send, status, {"detail": why}, www_authenticate=status == 401)


async def json_response(send, status: int, body: dict, www_authenticate: bool = False) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if www_authenticate:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
