"""The trainer's side of server mode: generation over HTTP, weights over a process group.

Every training process sends its own prompts, spread across the server's replicas. After an
optimizer step, training rank 0 alone broadcasts the new weights (in large flat buckets) to
all replicas' workers through a torch.distributed group it hosts; the other ranks wait at a
barrier, so no process asks for completions before the servers hold the new weights. Each
answer carries its weight version, which is checked against the trainer's.

A server that is down, dies, answers with a 5xx (its engine died) or stops answering raises
RolloutServerError within `connect_timeout_s` / `request_timeout_s`: the run stops with the
message naming the replica and the cause, its committed
checkpoints intact, and `resume=auto` continues once the server is back (a restarted server
gets the weights again: its /health `instance` changed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from urllib.parse import urlsplit

import torch

from plait import comm
from plait.models import pad_id_of
from plait.rollout.precision import rollout_precision
from plait.rollout.vllm_engine import sampling_dict, to_completion
from plait.rollout.weights import (
    SharedWeights,
    adapter_part,
    adapter_weights,
    full_weights,
    lora_rank,
    metas_of,
    plan_buckets,
    pushes_adapters,
    send_buckets,
    weight_group,
)
from plait.types import Completion, Prompt, SamplingParams


class RolloutServerError(RuntimeError):
    """A rollout server can't be reached, died, or answered wrongly."""


class TokenRefused(RolloutServerError):
    """The server is up but refuses this trainer's token: waiting for it will not help."""


def _resolve(future: Future, fn, *args) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # handed to the waiting thread
        future.set_exception(e)


BROADCAST_GRACE_S = 10.0
ABANDONED: list[Future] = []  # broadcasts left waiting on a peer that never joined (see _push)


def abandoned_collectives() -> int:
    """Threads of this process still inside a weight broadcast nobody will finish: a process
    exiting normally with one of them aborts in gloo's destructors, so the CLI exits at once."""
    return sum(not f.done() for f in ABANDONED)


def _in_thread(fn, *args) -> Future:
    """fn(*args) in a daemon thread of its own: a collective stuck on a dead peer is left behind."""
    future: Future = Future()
    threading.Thread(target=_resolve, args=(future, fn, *args), daemon=True).start()
    return future


def _wait_all(futures: list[Future]) -> None:
    """Wait for every future; the first one to fail raises at once."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    for f in done:
        f.result()


def _detail(response) -> str:
    """The reason a server gave for an error answer (its JSON `detail`, or the text)."""
    try:
        return str(response.json()["detail"])[:1000]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _resume_hint(own_process: bool = False) -> str:
    if own_process:
        return (
            "Checkpoints already written are intact: rerun with resume=auto to continue from the last one "
            "(a new generation process starts with it; its own error, if any, is printed above)."
        )
    return (
        "Checkpoints already written are intact: once the server is back (`plait rollout-server CONFIG`), "
        "rerun with resume=auto to continue from the last one."
    )


def _update_body(version: int, metas, buckets: list[list[int]], shared: bool = False) -> dict:
    """The /weights/update request announcing a push of `metas` (rollout/api.py UpdateRequest)."""
    described = [[m.name, m.dtype, list(m.shape)] for m in metas]
    return dict(version=version, metas=described, buckets=buckets, shared=shared)


def remote_engine(engine):
    """`engine` when it is a RemoteEngine, else None."""
    return engine if isinstance(engine, RemoteEngine) else None


class ServerClient:
    """HTTP to `plait rollout-server`s: the bearer token, one connection pool, and errors that name
    the server, the request and what to do. `label` names the server in them ("rollout server",
    "the teacher's server"); `token`: the servers' token (default: $PLAIT_ROLLOUT_TOKEN or
    rollout.vllm.token_file)."""

    def __init__(self, settings, label: str, token: str | None = None):
        import httpx

        from plait.auth import TokenError, bearer, resolve_token

        self.settings, self.label = settings, label
        if token is None:
            try:
                token, self.token_source = resolve_token(settings.token_file)
            except TokenError as e:
                raise RolloutServerError(str(e)) from None
        else:
            self.token_source = "this run's own token"
        self.http = httpx.Client(
            timeout=httpx.Timeout(settings.request_timeout_s, connect=min(10.0, settings.connect_timeout_s)),
            headers=bearer(token),
        )

    def call(self, method: str, url: str, path: str, body: dict | None = None, after: str = "") -> dict:
        """The JSON answer of one request; RolloutServerError (TokenRefused for a 401) naming the
        server and the cause otherwise. `after`: what to do, added where waiting for the server
        can help (a time-out, an unreachable or failed replica)."""
        import httpx

        after = f" {after}" if after else ""
        try:
            r = self.http.request(method, url + path, json=body)
        except httpx.TimeoutException as e:
            raise RolloutServerError(
                f"{self.label} {url} did not answer {path} within its time limit ({type(e).__name__}; "
                f"rollout.vllm.request_timeout_s={self.settings.request_timeout_s}).{after}"
            ) from None
        except httpx.HTTPError as e:
            raise RolloutServerError(
                f"{self.label} {url} is unreachable ({type(e).__name__}: {e}) during {path}.{after}"
            ) from None
        if r.status_code == 401:
            raise TokenRefused(
                f"{self.label} {url} refused this trainer's token (from {self.token_source}): give the trainer the "
                "server's token: the same PLAIT_ROLLOUT_TOKEN, or rollout.vllm.token_file naming the server's token "
                "file (`plait rollout-server` prints where it is)"
            )
        if r.status_code >= 500:  # a replica whose engine died or failed: as good as dead
            raise RolloutServerError(
                f"{self.label} {url} failed during {path} (HTTP {r.status_code}): {_detail(r)}.{after}"
            )
        if r.status_code != 200:
            raise RolloutServerError(f"{self.label} {url} answered {path} with HTTP {r.status_code}: {_detail(r)}")
        return r.json()

    def discover(self, servers: list[str], start: str) -> list[str]:
        """Every replica behind the URLs, waiting up to connect_timeout_s for them. `start`: how
        to start a missing server, for the error."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        urls: list[str] = []
        for base in servers:
            base = base.rstrip("/")
            while True:
                try:
                    health = self.call("GET", base, "/health")
                    break
                except TokenRefused:
                    raise
                except RolloutServerError as e:
                    if time.monotonic() > deadline:
                        raise RolloutServerError(
                            f"no rollout server at {base} after {self.settings.connect_timeout_s:.0f} s "
                            f"(rollout.vllm.connect_timeout_s): {e} {start}"
                        ) from None
                    time.sleep(1.0)
            host = urlsplit(base)
            urls += [f"{host.scheme}://{host.hostname}:{p}" for p in health["replicas"]]
        return list(dict.fromkeys(urls))

    def close(self) -> None:
        self.http.close()


class RemoteEngine:
    def __init__(
        self,
        cfg,
        tokenizer,
        view,
        device: torch.device,
        servers: list[str] | None = None,
        own_process: bool = False,
        token: str | None = None,
        shared_weights: str | None = None,
    ):
        """`own_process`: the server is the HF generation process this trainer started.
        `token`: the servers' token (default: $PLAIT_ROLLOUT_TOKEN or rollout.vllm.token_file).
        `shared_weights`: the /dev/shm file that process reads pushes from (else: the broadcast)."""
        self.own_process = own_process
        v = cfg.rollout.vllm
        self.inflight = cfg.rollout.inflight_updates  # versions then change mid-request: taken per token
        self.settings = v
        self.view = view
        self.pad_id = pad_id_of(tokenizer)
        self.dtype = torch.bfloat16 if rollout_precision(cfg, device) == "bf16" else torch.float32
        self.backend = v.sync_backend if v.sync_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        self.device = device
        self.client = ServerClient(v, "the HF generation process" if own_process else "rollout server", token)
        self.label = self.client.label
        self.urls = self.client.discover(
            servers or v.servers,
            "Start one with `plait rollout-server CONFIG` on the generation devices, or set rollout.vllm.servers",
        )
        self.version: int | None = None
        self.instances: dict[str, str] = {}  # replica -> instance id it had when it last got the weights
        self.group = None
        self.pool = ThreadPoolExecutor(max(2, len(self.urls)))
        self._last_sync: dict[str, float] = {}  # metrics of the last weights_for_round: stats()
        self.lora_push = cfg.rollout.lora_push
        self.shared = SharedWeights(shared_weights) if shared_weights else None

    # -------------------------------------------------------------- HTTP

    def _call(self, method: str, url: str, path: str, body: dict | None = None) -> dict:
        return self.client.call(method, url, path, body, after=_resume_hint(self.own_process))

    def _post_all(self, path: str, bodies: list[dict]) -> list:
        """POST one body to each replica at once; the futures of their answers."""
        return [self.pool.submit(self._call, "POST", u, path, b) for u, b in zip(self.urls, bodies)]

    # -------------------------------------------------------------- weights

    def weights_for_round(self, version: int):
        """Make the servers hold the trainer's weights after `version` rounds.
        Collective: every training process calls it (gathering sharded weights is)."""
        healths = self._healths() if comm.is_main() else []
        needed = comm.broadcast_object(self.version != version or self._restarted(healths))
        self._last_sync = {}
        if needed:
            # every process: gathering sharded weights (FSDP2's full_tensor) is a collective
            with self.view() as model:
                adapters = comm.broadcast_object(self.takes_adapter(model, healths) if comm.is_main() else None)
                with (adapter_weights if adapters else full_weights)(model) as weights:
                    if comm.is_main():
                        self.push_weights(weights, version, healths)
            comm.barrier()  # nobody generates before the servers hold the new weights
        self.version = version
        return contextlib.nullcontext()

    def _healths(self) -> list[dict]:
        return [self._call("GET", u, "/health") for u in self.urls]

    def health(self) -> dict:
        """Every replica's /health answer, by URL (RolloutServerError, with the cause a dead
        replica gives, when one cannot serve)."""
        return {"engine": "remote", "version": self.version, "replicas": dict(zip(self.urls, self._healths()))}

    def _restarted(self, healths: list[dict]) -> bool:
        return any(self.instances.get(u) != h["instance"] for u, h in zip(self.urls, healths))

    def push_weights(
        self, weights: list[tuple[str, torch.Tensor]], version: int, healths: list[dict] | None = None
    ) -> None:
        """Training rank 0 alone: send `weights` (checkpoint names) as version `version` to every
        replica, (re)joining the weight group first when a replica is new or restarted."""
        t0 = time.perf_counter()
        healths = healths if healths is not None else self._healths()
        if self.shared is not None:
            nbytes = self._push_shared(weights, version)
        else:
            if self._restarted(healths) or self.group is None:
                self._join(healths)
            nbytes = self._push(weights, version)
        self.instances = {u: h["instance"] for u, h in zip(self.urls, healths)}
        self.version = version
        gb, seconds = nbytes / 1e9, time.perf_counter() - t0
        self._last_sync = {
            "weight_sync/gb": gb,
            "weight_sync/seconds": seconds,
            "weight_sync/adapter": float(any(adapter_part(n) for n, _ in weights)),
            "weight_sync/seconds_per_gb": seconds / max(1e-9, gb),
            "weight_sync/shared_memory": float(self.shared is not None),
        }

    def takes_adapter(self, model, healths: list[dict] | None = None) -> bool:
        """Training rank 0: does this push send `model`'s LoRA adapter alone? rollout.lora_push
        allows it, the model's only trained weights are its adapter's, and every replica can
        apply one of its rank (the HF engine can; vLLM's servers where they were started with the
        run's model.lora, whose rank bound its rank must not pass)."""
        if self.lora_push == "merged" or not pushes_adapters(model):
            return False
        rank = lora_rank(model)
        return all(
            h.get("adapters") and rank <= (h.get("max_lora_rank") or rank)
            for h in (healths if healths is not None else self._healths())
        )

    def stats(self) -> dict[str, float]:
        """The last weights_for_round's broadcast: gigabytes sent and seconds per gigabyte (on
        training rank 0, which sends them; {} elsewhere and when the servers were up to date)."""
        return dict(self._last_sync)

    def _local_address(self) -> str:
        """This machine's address as the first server sees it (where it can reach our store)."""
        u = urlsplit(self.urls[0])
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            return s.getsockname()[0]

    def _join(self, healths: list[dict]) -> None:
        """(Re)build the weight group: rank 0 = this process, then each replica's workers."""
        host, port = self._local_address(), comm.free_port()
        sizes = [h["tensor_parallel_size"] for h in healths]
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        timeout = self.settings.request_timeout_s
        bodies = [
            dict(host=host, port=port, rank_offset=o, world=world, backend=self.backend, timeout_s=timeout)
            for o in offsets
        ]
        futures = self._post_all("/weights/join", bodies)  # they block in the rendezvous until we join too
        # The rendezvous waits up to `timeout` for every replica: a replica that dies or refuses
        # the join must stop the run now, so the group forms beside the join requests.
        group = _in_thread(weight_group, host, port, 0, world, self.backend, timeout)
        _wait_all([group, *futures])
        self.group = group.result()

    def _engine_dtypes(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        # the engine's dtype (half the bytes in bf16); an adapter's factors stay as trained, so the
        # engine's merge computes what the trainer's would
        return [(n, t if adapter_part(n) else t.to(self.dtype)) for n, t in weights]

    def _push_shared(self, weights: list[tuple[str, torch.Tensor]], version: int) -> int:
        """Write the weights into the shared file, then have the generation process read them."""
        metas = self.shared.write(self._engine_dtypes(weights))
        buckets = plan_buckets(metas, 2**62)  # one per dtype: the request's format; nothing is sent in them
        _wait_all(self._post_all("/weights/update", [_update_body(version, metas, buckets, shared=True)]))
        return sum(m.nbytes for m in metas)

    def _push(self, weights: list[tuple[str, torch.Tensor]], version: int) -> int:
        weights = self._engine_dtypes(weights)
        metas = metas_of(weights)
        buckets = plan_buckets(metas, self.settings.sync_bucket_mb * 2**20)
        futures = self._post_all("/weights/update", [_update_body(version, metas, buckets)] * len(self.urls))
        # A replica that dies before its side of the broadcast connects leaves ours waiting for the
        # group's whole timeout: its failed update request stops the push instead.
        sending = _in_thread(send_buckets, self.group, [t for _, t in weights], buckets, self.device)
        try:
            _wait_all([sending, *futures])
        except RolloutServerError:
            self.group = None
            # Peers that died make the broadcast fail at once: let it, so that no thread is left
            # inside gloo (a process exiting with one there aborts). One that never connected keeps
            # it waiting: it is left behind, and counted for the command line's exit.
            try:
                sending.exception(timeout=BROADCAST_GRACE_S)
            except FuturesTimeout:
                ABANDONED.append(sending)
            raise
        except RuntimeError as e:  # a receiver died mid-broadcast (it may fail before its update request)
            self.group = None
            raise RolloutServerError(
                f"{self.label} {', '.join(self.urls)}: sending it the weights failed ({e}). "
                f"{_resume_hint(self.own_process)}"
            ) from None
        return sum(m.nbytes for m in metas)

    # -------------------------------------------------------------- generation

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """Prompts go round-robin to the replicas (offset by rank, so processes don't all start
        on replica 0); each replica's share is one request, all sent at once."""
        r = len(self.urls)
        shares: list[list[int]] = [[] for _ in range(r)]
        for i in range(len(prompts)):
            shares[(i + comm.rank()) % r].append(i)
        # vLLM reads each prompt's `sampling`; the HF generation process reads `params`, `n` and
        # each prompt's dataset index (its group's random stream, as in the in-process engine)
        bodies = [
            dict(
                prompts=[
                    dict(
                        token_ids=prompts[i].token_ids,
                        index=prompts[i].index,
                        sampling=sampling_dict(params, n, prompts[i]),
                    )
                    for i in share
                ],
                params=dataclasses.asdict(params),
                n=n,
            )
            for share in shares
        ]
        futures = [
            self.pool.submit(self._call, "POST", u, "/generate", b) if b["prompts"] else None
            for u, b in zip(self.urls, bodies)
        ]
        out: list[list[Completion]] = [[] for _ in prompts]
        for url, share, fut in zip(self.urls, shares, futures):
            if fut is None:
                continue
            answer = fut.result()
            if answer["version"] != self.version and not self.inflight:
                raise RolloutServerError(
                    f"rollout server {url} sampled with weight version {answer['version']}, but the trainer is at "
                    f"{self.version}: another trainer is updating it? One run per rollout server."
                )
            for i, outs in zip(share, answer["outputs"]):
                out[i] = [to_completion(prompts[i], o, answer["version"]) for o in outs]
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.client.close()
        if self.shared is not None:
            self.shared.close()
