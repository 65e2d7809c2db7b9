"""Rollout engines: turn prompts into groups of completions. See base.RolloutEngine."""

import contextlib

from plait.rollout.base import RolloutEngine
from plait.rollout.hf import HFEngine
from plait.rollout.precision import rollout_precision


__all__ = ["RolloutEngine", "HFEngine", "make_engine", "make_generator", "generation_site", "ahead_of_trainer"]


def generation_site(cfg) -> str:
    """Where completions are sampled, the one place this is decided: "trainer" (the HF engine
    or colocated vLLM, in each training process), "process" (the HF engine's generation
    process, started by training rank 0) or "server" (`plait rollout-server` replicas)."""
    r = cfg.rollout
    if r.engine == "vllm":
        return "server" if r.vllm.mode == "server" else "trainer"
    return "process" if r.generation_process or r.max_staleness > 0 else "trainer"


def ahead_of_trainer(cfg) -> bool:
    """Rounds come from a producer thread on training rank 0 (train/rollouts.py): asynchronous
    runs, and any run whose HF engine has a process of its own."""
    return cfg.rollout.max_staleness > 0 or generation_site(cfg) == "process"


def make_engine(cfg, model, tokenizer, view=None, device=None) -> RolloutEngine:
    """The engine named by `cfg.rollout.engine`. `model` is the training backend's module and
    `view` its context that yields full weights (gathered when sharded): the HF engine samples
    from them, vLLM engines copy them in after each optimizer step."""
    if cfg.rollout.engine == "hf":
        return HFEngine(
            model,
            tokenizer,
            batch_size=cfg.rollout.batch_size,
            precision=rollout_precision(cfg, device or next(model.parameters()).device),
            view=view,
            packed_weights=cfg.rollout.packed_weights,
            cuda_graphs=cfg.rollout.cuda_graphs,
        )
    import torch

    device = device or torch.device("cpu")
    view = view or (lambda: contextlib.nullcontext(model))
    if cfg.rollout.vllm.mode == "server":
        from plait.rollout.remote import RemoteEngine

        return RemoteEngine(cfg, tokenizer, view, device)
    from plait.models import resolve_model_path
    from plait.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(cfg, str(resolve_model_path(cfg.model.name_or_path)), tokenizer, view, device)


def shared_weights_path(cfg, device) -> str | None:
    """Where the HF generation process gets its weights from: a new file in /dev/shm when the
    weights live in CPU memory and rollout.shared_memory_weights is on, else None (the broadcast)."""
    import os
    import uuid
    from pathlib import Path

    if not cfg.rollout.shared_memory_weights or device.type != "cpu" or not Path("/dev/shm").is_dir():
        return None
    return f"/dev/shm/plait-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def make_generator(cfg, tokenizer, device):
    """The engine of asynchronous generation (training rank 0): the rollout servers (vLLM,
    server mode), or a generation process of the HF engine started here. Returns the engine
    (a RemoteEngine: weights go in with `push_weights`) and a function that stops it."""
    import torch

    from plait.rollout.remote import RemoteEngine

    device = device or torch.device("cpu")
    identity = lambda: contextlib.nullcontext(None)  # noqa: E731 - weights arrive through push_weights()
    if cfg.rollout.engine == "vllm":
        engine = RemoteEngine(cfg, tokenizer, identity, device)
        return engine, engine.close
    from plait.auth import new_token
    from plait.rollout import replica
    from plait.rollout.hf_process import start_generation_process

    token = new_token()  # this run's own: the process is ours alone
    shared = shared_weights_path(cfg, device)
    url, proc = start_generation_process(cfg, device, max(600.0, cfg.rollout.vllm.connect_timeout_s), token, shared)
    engine = RemoteEngine(
        cfg, tokenizer, identity, device, servers=[url], own_process=True, token=token, shared_weights=shared
    )

    def close():
        engine.close()
        replica.stop(proc)

    return engine, close
