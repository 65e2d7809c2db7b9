"""`plait rollout-server`: vLLM on its own devices (or nodes), serving the trainer over HTTP.
The same API serves the HF engine's generation process of asynchronous runs (hf_process.py).

One command starts `--dp` engine replicas, each a process with its own HTTP port (base port +
replica) and `--tp` devices. The trainer finds all replicas from any one URL (GET /health
lists them), spreads its requests across them, and after each optimizer step broadcasts the new
weights to every replica's workers through a torch.distributed group it hosts (see
rollout/remote.py). Every answer carries the weight version it was sampled with.

The HTTP API (JSON):
Every request carries `Authorization: Bearer TOKEN` (rollout/auth.py); without it only a bare
GET /health answers ({ok: true}), anything else is a 401. Requests are checked before they reach
the engine (rollout/api.py): sizes, sampling parameters, and who may join the weight group.

  GET  /health          -> {version, instance, replica, replicas, tensor_parallel_size, model, running, updating};
                        503 {detail} once the replica's engine has died
  POST /generate        {prompts: [{token_ids, sampling}]}
                        -> {version, outputs: [[{token_ids, text, logprobs, finish_reason, stop_reason}]]}
  POST /logprobs        {sequences: [{token_ids, start}], temperature, top_k}
                        -> {version, logprobs: [[log p(token_ids[t] | token_ids[:t]) for t >= start]]}
                        (top_k > 0: also top_ids and top_logprobs, the k likeliest tokens at each position)
                        (a distillation teacher's scores, vLLM replicas only: plait.train.teacher)
  POST /weights/join    {host, port, rank_offset, world, backend, timeout_s}: join the trainer's weight
                        group; `host` must be the caller's own address (or one allowed by --weights-from)
  POST /weights/update  {version, metas, buckets, shared}: receive the broadcast, only from the client that
                        joined (shared: read them from the /dev/shm file the trainer that started this
                        HF generation process named; no other replica has one); generation waits meanwhile
                        (HF with in-flight updates: received beside generation, swapped in between tokens)

`instance` changes whenever a replica restarts, so a trainer knows to send it the weights again.

A replica is never half dead: when its engine dies (vLLM's engine-core process, or an HF
generation that raised), every request gets a 503 naming the cause and the replica's process
exits with code 1, as vLLM's own server does, so that `plait rollout-server` (and whatever
supervises it: systemd, Ray, Kubernetes) sees it and restarts it. The engine is watched between
requests too, so a death is noticed before the next request comes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from plait.auth import ENV
from plait.rollout import replica as replica_process
from plait.rollout.api import (
    ApiError,
    GenerateRequest,
    Guard,
    JoinRequest,
    Limits,
    LogprobsRequest,
    UpdateRequest,
    check_generate,
    check_join,
    check_logprobs,
    check_update,
    log,
)
from plait.rollout.vllm_engine import Adapters, refused_adapter
from plait.rollout.weights import adapter_part


class _Gate:
    """Generation requests run concurrently; a weight update waits for them to finish and
    holds new ones back until the new weights are in (no completion mixes two versions)."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.running = 0
        self.updating = False

    @asynccontextmanager
    async def generating(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.running += 1
        try:
            yield
        finally:
            async with self.cond:
                self.running -= 1
                self.cond.notify_all()

    @asynccontextmanager
    async def updating_weights(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.updating = True
            await self.cond.wait_for(lambda: self.running == 0)
        try:
            yield
        finally:
            async with self.cond:
                self.updating = False
                self.cond.notify_all()


def one_process_worker() -> None:
    """vLLM's model worker runs inside its engine-core process (the uniprocess executor) instead
    of a process of its own. vLLM's CPU platform turns a one-device engine's executor into its
    multiprocess one unless VLLM_ENABLE_V1_MULTIPROCESSING is 0 (the setting it reads there; the
    AsyncLLM front end keeps its engine-core process whatever it says), and the extra process
    imports vLLM and torch again: a replica of a tiny model started in 29 s with it, 23 s
    without (2-core Zen 4), with the same engine core and the same model runner. The setting
    makes vLLM warn that its seed may touch the launching process's random state; this replica
    process draws no random numbers, so that one warning is dropped."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    seed_warning = "The global random seed is set to"
    logging.getLogger("vllm.engine.arg_utils").addFilter(lambda record: not str(record.msg).startswith(seed_warning))


class VllmReplica:
    """A vLLM AsyncLLM engine behind the HTTP API (the default `plait rollout-server`)."""

    inflight = False  # a weight update waits for the running requests (they finish on their weights)

    def __init__(self, engine_kwargs: dict):
        self.kwargs = engine_kwargs
        self.engine = None
        # vLLM's own LoRA (started with model.lora): adapter pushes are loaded as LoRA requests
        self.adapters = Adapters() if engine_kwargs.get("enable_lora") else None
        self.base_replaced = False  # a whole push replaced the base an adapter would be added to

    def describe(self) -> dict:
        return dict(
            tensor_parallel_size=self.kwargs.get("tensor_parallel_size", 1),
            model=self.kwargs["model"],
            adapters=self.adapters is not None and not self.base_replaced,  # trainers push merged weights else
            max_lora_rank=self.kwargs.get("max_lora_rank"),
        )

    def limits(self) -> tuple[int, int]:
        """(longest prompt + completion, vocabulary size) of the served model."""
        return self.engine.model_config.max_model_len, self.engine.model_config.get_vocab_size()

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if current_platform.is_cpu() and self.kwargs.get("tensor_parallel_size", 1) == 1:
            one_process_worker()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.kwargs))

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        engine.shutdown()
        del engine  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit (a traceback there)
        if self.adapters is not None:
            self.adapters.close()

    def failure(self) -> str | None:
        """Why the engine can serve nothing more (its engine-core process died), or None."""
        if self.engine is None or not self.engine.errored:
            return None
        err = self.engine.dead_error
        return f"{type(err).__name__}: {err}"

    async def _one(self, req: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from plait.rollout.vllm_engine import output_dicts

        # FINAL_ONLY: one answer holding all n completions (streamed answers come per completion)
        params = SamplingParams(**req["sampling"], output_kind=RequestOutputKind.FINAL_ONLY)
        lora = self.adapters.current if self.adapters is not None else None
        prompt = {"prompt_token_ids": req["token_ids"]}
        async for out in self.engine.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
            final = out
        return output_dicts(final)

    async def generate(self, body: dict) -> list:
        return await asyncio.gather(*(self._one(r) for r in body["prompts"]))

    async def _score(self, seq: dict, top_k: int) -> dict:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # prompt_logprobs=k: each prompt position's log-prob of the token that is there, and the k likeliest
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, output_kind=RequestOutputKind.FINAL_ONLY)
        ids = seq["token_ids"]
        async for out in self.engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
            final = out
        scored = final.prompt_logprobs[seq["start"] :]  # {token: Logprob} per position (ranks from 1)
        answer = {"logprobs": [position[t].logprob for position, t in zip(scored, ids[seq["start"] :])]}
        if top_k:
            tops = [sorted((lp.rank, t, lp.logprob) for t, lp in p.items() if lp.rank <= top_k) for p in scored]
            answer["top_ids"] = [[t for _, t, _ in top] for top in tops]
            answer["top_logprobs"] = [[v for _, _, v in top] for top in tops]
        return answer

    async def logprobs(self, body: dict) -> list:
        if body["temperature"] != 1.0:  # vLLM's prompt log-probs are the model's own distribution
            raise ValueError(
                f"a vLLM replica scores at temperature 1 only (asked {body['temperature']}): sample at "
                "rollout.temperature=1, or hold the teacher in the trainer (teacher.site=trainer or process)"
            )
        return await asyncio.gather(*(self._score(seq, body["top_k"]) for seq in body["sequences"]))

    async def join(self, args: tuple) -> None:
        await self.engine.collective_rpc("plait_join_weight_group", args=args)

    async def receive(self, metas: list, buckets: list, version: int, shared: bool = False) -> None:
        if shared:
            raise ValueError("a vLLM replica takes weights through the weight group only, not shared memory")
        adapter = [adapter_part(m[0]) is not None for m in metas]
        if any(adapter):
            await self._receive_adapter(metas, buckets, version, all(adapter))
            return
        await self.engine.collective_rpc("plait_receive_weights", args=(metas, buckets))
        await self.engine.reset_prefix_cache()  # cached prompt KV came from the old weights
        if self.adapters is not None:  # the base now holds whatever the push merged in
            self.base_replaced = True
            await self._remove(self.adapters.drop())

    async def _receive_adapter(self, metas: list, buckets: list, version: int, adapter_only: bool) -> None:
        if self.adapters is None:
            raise ValueError(
                "a LoRA adapter push to a replica started without vLLM's LoRA: start `plait rollout-server` with "
                "the run's config (its model.lora), or set rollout.lora_push=merged"
            )
        if not adapter_only:
            raise ValueError("a push that mixes LoRA adapter parts with whole weights")
        if self.base_replaced:
            raise ValueError(
                "a LoRA adapter push after a whole-weights push replaced the base it would be added to: restart "
                "the server (or set rollout.lora_push=merged)"
            )
        request = self.adapters.request(version)  # the first worker writes its folder
        await self.engine.collective_rpc("plait_receive_adapter", args=(metas, buckets, request.lora_path))
        try:
            await self.engine.add_lora(request)
        except Exception as e:
            raise refused_adapter(e) from e
        await self._remove(self.adapters.swap(request))

    async def _remove(self, request) -> None:
        if request is not None:
            await self.engine.remove_lora(request.lora_int_id)


WATCH_S = 0.5  # how often an idle replica checks that its engine is alive


def build_app(engine, replica: int, ports: list[int], token: str, limits: Limits | None = None, on_dead=None):
    """The FastAPI app of one replica serving `engine` (VllmReplica or HFReplica), which starts
    with the app, behind the token and request bounds of rollout/api.py. `on_dead(cause)` is
    called once when the engine dies (serve_replica then stops the process with code 1)."""
    limits = limits or Limits()
    state = dict(version=0, instance=uuid.uuid4().hex, joined_by=None, dead=None, running=0)
    gate = _Gate()
    death = asyncio.Event()

    def died(cause: str) -> None:
        if state["dead"] is None:
            state["dead"] = f"the engine of replica {replica} died ({cause})"
            death.set()
            log.error("%s: this server stops so that its supervisor restarts it", state["dead"])
            if on_dead is not None:
                on_dead(state["dead"])

    def alive() -> None:
        if state["dead"] is not None:
            raise ApiError(503, f"{state['dead']}; this replica is exiting")

    async def unless_dead(work):
        """Await `work`, or answer 503 as soon as the engine is seen dead: a request the engine
        took in while dying may never be answered by it (vLLM 0.32 registers a request after
        checking the engine is alive and can miss the error it sends the requests it knows)."""
        task = asyncio.ensure_future(work)
        dead = asyncio.ensure_future(death.wait())
        try:
            done, _ = await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not task.done():  # the engine died, or this request was cancelled: stop its generation
                task.cancel()
        if task not in done:
            alive()
        return task.result()

    async def engine_request(start, what: str):
        """One request's work on the engine (`start()` begins it), under the gate (a weight update
        waits for it): (the weight version it ran on, its result). The engine refusing it is a 400
        naming why; the engine dying under it, a 503; any other failure, a 500."""
        async with gate.generating():
            version = state["version"]
            state["running"] += 1
            try:
                return version, await unless_dead(start())
            except ApiError:
                raise
            except ValueError as e:  # the engine rejects a request (prompt too long, bad parameter): say why
                raise ApiError(400, f"the engine rejected a request: {e}") from e
            except Exception as e:
                cause = engine.failure()
                if cause is not None:  # the engine died under this request
                    died(cause)
                    alive()
                raise ApiError(500, f"{what} failed: {type(e).__name__}: {e}") from e
            finally:
                state["running"] -= 1

    async def watch() -> None:
        while state["dead"] is None:
            cause = engine.failure()
            if cause is not None:
                died(cause)
            await asyncio.sleep(WATCH_S)

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        watcher = asyncio.create_task(watch())
        yield
        watcher.cancel()
        await engine.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        client = request.client.host if request.client else "?"
        log.warning("refused %s %s from %s: %d %s", request.method, request.url.path, client, e.status, e.message)
        return JSONResponse({"detail": e.message}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        where = "; ".join(f"{'.'.join(map(str, err['loc'][1:]))}: {err['msg']}" for err in e.errors()[:5])
        return await api_error(request, ApiError(400, f"malformed request: {where}"))

    def client_of(request: Request) -> str:
        return request.client.host if request.client else "?"

    @app.get("/health")
    async def health(request: Request):
        if state["dead"] is not None:  # unhealthy at once, to a probe without the token too
            body = dict(detail=state["dead"]) if request.state.authorized else dict(ok=False)
            return JSONResponse(body, status_code=503)
        if not request.state.authorized:  # liveness only: nothing about the run without the token
            return dict(ok=True)
        return dict(
            version=state["version"],
            instance=state["instance"],
            replica=replica,
            replicas=ports,
            running=state["running"],
            updating=gate.updating,  # a weight update is waiting for the running requests, or loading
            **engine.describe(),
        )

    @app.post("/generate")
    async def generate(req: GenerateRequest):
        alive()
        check_generate(req, limits, *engine.limits())
        body = req.model_dump()
        version, outputs = await engine_request(lambda: engine.generate(body), "generation")
        return dict(version=version, outputs=outputs)

    @app.post("/logprobs")
    async def logprobs(req: LogprobsRequest):
        alive()
        if not hasattr(engine, "logprobs"):
            raise ApiError(
                404,
                "this replica does not score sequences (the HF generation process); serve the teacher "
                "with `plait rollout-server --model TEACHER`",
            )
        check_logprobs(req, limits, *engine.limits())
        version, scores = await engine_request(lambda: engine.logprobs(req.model_dump()), "scoring")
        answer = dict(version=version, logprobs=[s["logprobs"] for s in scores])
        if req.top_k:
            answer.update({key: [s[key] for s in scores] for key in ("top_ids", "top_logprobs")})
        return answer

    @app.post("/weights/join")
    async def join(req: JoinRequest, request: Request):
        alive()
        host = check_join(req, client_of(request), limits, engine.describe()["tensor_parallel_size"])
        try:
            await engine.join((host, req.port, req.rank_offset, req.world, req.backend, req.timeout_s))
        except Exception as e:  # the trainer sees why, the server stays up for the next trainer
            state["joined_by"] = None
            raise ApiError(500, f"joining the weight group failed: {e}") from e
        state["joined_by"] = client_of(request)
        return dict(ok=True)

    async def receive(req: UpdateRequest):
        try:
            await engine.receive([list(m) for m in req.metas], req.buckets, req.version, req.shared)
        except ValueError as e:
            raise ApiError(400, f"weights refused: {e}") from e
        except Exception as e:
            raise ApiError(500, f"receiving weights failed: {e}") from e
        state["version"] = req.version

    @app.post("/weights/update")
    async def update(req: UpdateRequest, request: Request):
        alive()
        check_update(req, client_of(request), state["joined_by"])
        if engine.inflight:  # received beside the running requests, swapped in between their tokens
            await receive(req)
        else:
            async with gate.updating_weights():
                await receive(req)
        return dict(ok=True, version=state["version"])

    return Guard(app, token, limits)


def serve_replica(spec: dict, replica: int, host: str, ports: list[int], limits: dict | None = None) -> None:
    """`spec`: {"engine": "hf", ...HFReplica's settings} or vLLM's engine arguments. The token
    comes from the environment (PLAIT_ROLLOUT_TOKEN), set by whoever started this process.
    Exits with code 1 when the engine dies."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    token = os.environ.pop(ENV, "")  # not inherited by vLLM's workers or anything they start
    if not token:
        raise SystemExit(f"plait.rollout.server: no token in ${ENV}: start servers with `plait rollout-server`")
    if spec.get("engine") == "hf":
        from plait.rollout.hf_process import HFReplica

        engine = HFReplica(spec)
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        engine = VllmReplica(spec)
    cause = serve(engine, replica, host, ports, token, Limits(**(limits or {})))
    if cause is not None:
        raise SystemExit(f"plait rollout-server: {cause}; exiting with code 1 so that it is restarted")


def serve(engine, replica: int, host: str, ports: list[int], token: str, limits: Limits | None = None) -> str | None:
    """Serve `engine` as replica `replica` until this process is told to stop (-> None) or the
    engine dies (-> the cause, once the requests in flight have their 503)."""
    import uvicorn

    death: list[str] = []
    server = None

    def on_dead(cause: str) -> None:
        death.append(cause)
        server.should_exit = True

    app = build_app(engine, replica, ports, token, limits, on_dead=on_dead)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=ports[replica], log_level="warning"))
    server.run()
    return death[0] if death else None


def run_servers(
    engine_kwargs: dict,
    dp: int,
    host: str,
    port: int,
    token: str,
    limits: dict | None = None,
    say=print,
    start_timeout_s: float = 900,
) -> int:
    """Start `dp` replicas and watch them; return an exit code when one dies or on Ctrl-C/SIGTERM.
    Each replica runs in its own session so that stopping it stops vLLM's worker processes too."""
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    ports = [port + i for i in range(dp)]
    procs = [
        replica_process.start(engine_kwargs, i, host, ports, token, replica_process.pinning(i, tp, dp), limits)
        for i in range(dp)
    ]
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        replica_process.wait_healthy([f"http://{shown}:{p}" for p in ports], procs, start_timeout_s)
        say(
            f"rollout server ready: {dp} replica(s) x tp={tp} of {engine_kwargs['model']} at "
            + ", ".join(f"http://{shown}:{p}" for p in ports)
            + f"  (trainer: rollout.engine=vllm rollout.vllm.mode=server rollout.vllm.servers=[http://{shown}:{port}])"
        )
        while stop["signal"] is None:
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    say(
                        f"rollout server: replica {i} (port {ports[i]}) exited with code {p.returncode} "
                        "(its cause is printed above); stopping the others"
                    )
                    return 1
            time.sleep(0.5)
        say(f"rollout server: stopping on signal {stop['signal']}")
        return 0
    except RuntimeError as e:
        say(f"rollout server failed: {e}")
        return 1
    finally:
        for p in procs:
            replica_process.stop(p)
        for s, h in old.items():
            signal.signal(s, h)


def thread_lock_for_progress_bars() -> None:
    """tqdm's bars share a lock between processes by default: a named semaphore, unlinked when
    the process exits normally. vLLM's engine core, which loads the weights under such a bar when
    the model runs in it (one_process_worker), is stopped by the second of two signals when its whole
    process group is signalled (Ctrl-C, a supervisor stopping the group): it exits in the middle of
    its own shutdown, and the resource tracker then warns of a leaked semaphore at every stop. No
    other process draws into that process's bars, so a thread lock does."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


# Processes that vLLM spawns from a replica (its engine core) import the replica's main module,
# this one, under this name first (multiprocessing's spawn start method)
if __name__ == "__mp_main__":
    thread_lock_for_progress_bars()

# one replica: python -m plait.rollout.server SPEC_JSON REPLICA HOST PORTS_JSON [LIMITS_JSON]
if __name__ == "__main__":
    limits = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    serve_replica(json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), limits)
