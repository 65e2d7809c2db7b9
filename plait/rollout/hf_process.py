"""The HF engine in a generation process of its own, for asynchronous runs.

With `rollout.max_staleness >= 1` and `rollout.engine: hf`, training rank 0 starts one child
process (`start_generation_process`) that holds its own copy of the weights and serves the
same HTTP API as `plait rollout-server` (server.py): the trainer talks to it through the same
RemoteEngine, and new weights reach it through the same bucketed broadcast as a vLLM server's.
So the asynchronous machinery is one code path for both engines, and it runs (and is tested)
on a CPU without vLLM.

With `rollout.inflight_updates`, new weights are received beside a running generation and
swapped in between two decoding steps (PipelineRL); each token records the version that
sampled it. Decoding then skips the packed weight copies (they would hold the old weights).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from dataclasses import asdict

import torch

from plait.models import text_config
from plait.rollout import replica
from plait.rollout.precision import rollout_precision
from plait.rollout.weights import (
    SharedWeights,
    TensorMeta,
    adapter_part,
    apply_adapter,
    receive_buckets,
    weight_group,
)
from plait.types import Prompt, SamplingParams


class HFReplica:
    """The engine behind one generation process's HTTP API (see server.build_app)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.inflight = bool(spec.get("inflight"))
        self.device = torch.device(spec.get("device", "cpu"))
        self.version = 0
        self.pending: tuple[int, dict[str, torch.Tensor]] | None = None  # in-flight: received, not yet swapped in
        self.swap = threading.Lock()
        self.busy = asyncio.Lock()  # one generation at a time: it uses every thread it has
        self.group = None
        self.engine = None
        self.failed: str | None = None
        # LoRA pushes: the base weights an adapter is added to (copied at the first such push, while
        # the model still holds what it loaded), and the weights a whole push has overwritten since
        self.base: dict[str, torch.Tensor] = {}
        self.overwritten: set[str] = set()
        # pushes through a file in /dev/shm the trainer that started this process named
        self.shared = SharedWeights(spec["shared_weights"]) if spec.get("shared_weights") else None

    def describe(self) -> dict:
        return dict(
            tensor_parallel_size=1, model=self.spec["model"], engine="hf", adapters=True, shared=self.shared is not None
        )

    def limits(self) -> tuple[int, int]:
        """(longest prompt + completion, vocabulary size) of the served model."""
        text = text_config(self.engine.model.config)
        return int(getattr(text, "max_position_embeddings", None) or 2**31 - 1), int(text.vocab_size)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _watch_parent(self) -> None:
        """The trainer that started this process died (even by SIGKILL): stop too, so no
        orphan keeps the port and a copy of the model."""
        parent = self.spec.get("parent")
        while parent and os.getppid() == parent:
            time.sleep(1.0)
        if parent:
            if self.shared is not None:  # the trainer can no longer remove it
                self.shared.close()
            os._exit(0)

    def _load(self) -> None:
        threading.Thread(target=self._watch_parent, name="plait-parent-watch", daemon=True).start()
        from plait.models import load_model, load_tokenizer
        from plait.rollout.hf import HFEngine

        if self.spec.get("threads"):
            torch.set_num_threads(self.spec["threads"])
        precision = self.spec["precision"]
        model = load_model(self.spec["model"], "bfloat16" if precision == "bf16" else "float32").to(self.device)
        model.eval()
        self.params = dict(model.state_dict(keep_vars=True))
        self.engine = HFEngine(
            model,
            load_tokenizer(self.spec["model"]),
            batch_size=self.spec["batch_size"],
            precision=precision,
            packed_weights=self.spec["packed_weights"] and not self.inflight,
            on_token=self._current_version if self.inflight else None,
            cuda_graphs=self.spec.get("cuda_graphs", True),
        )

    async def stop(self) -> None:
        pass

    async def generate(self, body: dict) -> list:
        prompts = [Prompt(p["index"], "", p["token_ids"]) for p in body["prompts"]]
        params = SamplingParams(**body["params"])
        async with self.busy:
            try:
                groups = await asyncio.to_thread(self.engine.generate, prompts, params, body["n"])
            except ValueError:  # a request the engine refuses: the engine itself is fine
                raise
            except Exception as e:
                # Anything else broke mid-decode (out of memory, a device error, a bug): what the
                # model and its caches hold is unknown, so the replica stops and is restarted clean.
                self.failed = f"{type(e).__name__}: {e}"
                raise
        return [[completion_dict(c) for c in group] for group in groups]

    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a generation raised), or None."""
        return self.failed

    async def join(self, args: tuple) -> None:
        self.group = None
        self.group = await asyncio.to_thread(weight_group, *args)

    async def receive(self, metas: list, buckets: list, version: int, shared: bool = False) -> None:
        if shared and self.shared is None:
            raise ValueError("this generation process was started without a shared-memory file")
        metas_ = [TensorMeta(n, d, tuple(s)) for n, d, s in metas]
        targets = [(adapter_part(m.name) or (m.name,))[0] for m in metas_]
        unknown = [n for n in targets if n not in self.params]
        if unknown:
            raise ValueError(f"weights the model does not have: {unknown[:5]} (is it the trainer's model?)")
        adapted = {n for m, n in zip(metas_, targets) if adapter_part(m.name)}
        lost = sorted(adapted & self.overwritten - set(self.base))
        if lost:
            raise ValueError(
                f"a LoRA adapter for {lost[0]}, whose base weights a whole push has overwritten since this server "
                "started: restart the server (or set rollout.lora_push=merged)"
            )
        if not self.inflight:  # the gate holds generation back: load in place
            await asyncio.to_thread(self._receive_into, metas_, buckets, None, shared)
            self.version = version
            return
        staged: dict[str, torch.Tensor] = {}
        await asyncio.to_thread(self._receive_into, metas_, buckets, staged, shared)
        with self.swap:
            self.pending = (version, staged)
        if not self.busy.locked():  # nothing decoding: swap now, so /health's version is the model's
            self._current_version()

    def _pushed(self, metas: list[TensorMeta], buckets: list, shared: bool):
        """The pushed tensors, bucket by bucket: views of the shared file, or received broadcasts."""
        if not shared:
            return receive_buckets(self.group, metas, buckets, self.device)
        return [list(zip((m.name for m in metas), self.shared.views(metas)))]

    def _receive_into(self, metas: list[TensorMeta], buckets: list, staged: dict | None, shared: bool = False) -> None:
        adapters: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for bucket in self._pushed(metas, buckets, shared):
                for name, t in bucket:
                    part = adapter_part(name)
                    if part is not None:
                        adapters.setdefault(part[0], {})[part[1]] = t
                        continue
                    self.overwritten.add(name)
                    if staged is None:
                        self.params[name].copy_(t)
                    else:  # a view of this bucket's own buffer needs no copy; the shared file's is rewritten
                        staged[name] = t.clone() if shared else t
            for name, parts in adapters.items():
                base = self.base.setdefault(name, self.params[name].detach().clone())
                merged = apply_adapter(base, parts)
                if staged is None:
                    self.params[name].copy_(merged)
                else:
                    staged[name] = merged

    def _current_version(self) -> int:
        """Between two decoding steps (in-flight mode): swap in weights that arrived."""
        with self.swap:
            if self.pending is not None:
                version, staged = self.pending
                with torch.no_grad():
                    for name, t in staged.items():
                        self.params[name].copy_(t)
                self.version, self.pending = version, None
            return self.version


def completion_dict(c) -> dict:
    """A Completion as the JSON the API answers with (plait's own finish reason kept)."""
    d = asdict(c)
    d["reason"] = d.pop("finish_reason")
    for k in ("prompt_index", "truncated", "weight_version"):
        d.pop(k)
    return d


def generation_spec(cfg, device: torch.device, shared_weights: str | None = None) -> dict:
    """The generation process's settings, from the run's config (`shared_weights`: the file in
    /dev/shm pushes come through, or None for the broadcast)."""
    from plait.models import resolve_model_path

    r = cfg.rollout
    return dict(
        engine="hf",
        model=str(resolve_model_path(cfg.model.name_or_path)),
        precision=rollout_precision(cfg, device),
        batch_size=r.batch_size,
        packed_weights=r.packed_weights,
        cuda_graphs=r.cuda_graphs,
        threads=r.generator_threads,
        device=str(device),
        inflight=r.inflight_updates,
        shared_weights=shared_weights,
    )


def start_generation_process(
    cfg, device: torch.device, timeout_s: float, token: str, shared_weights: str | None = None
) -> tuple[str, subprocess.Popen]:
    """Start the HF generation process on this machine, listening on loopback only and taking
    requests with `token` (the run's own); return its URL and process once it answers /health.
    Its log goes to this process's stderr."""
    from plait import comm

    port = comm.free_port()
    spec = {**generation_spec(cfg, device, shared_weights), "parent": os.getpid()}
    proc = replica.start(spec, 0, "127.0.0.1", [port], token, {"OMP_NUM_THREADS": str(spec["threads"] or 1)})
    url = f"http://127.0.0.1:{port}"
    try:
        replica.wait_healthy([url], [proc], timeout_s)
    except RuntimeError:
        replica.stop(proc)
        raise
    return url, proc
