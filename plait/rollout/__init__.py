"""Rollout engines: turn prompts into groups of completions. See base.RolloutEngine."""

import contextlib

from plait.rollout.base import RolloutEngine
from plait.rollout.hf import HFEngine


__all__ = ["RolloutEngine", "HFEngine", "make_engine"]


def make_engine(cfg, model, tokenizer, view=None, device=None) -> RolloutEngine:
    """The engine named by `cfg.rollout.engine`. `model` is the training backend's module and
    `view` its context that yields full weights (gathered when sharded): the HF engine samples
    from them, vLLM engines copy them in after each optimizer step."""
    if cfg.rollout.engine == "hf":
        return HFEngine(
            model,
            tokenizer,
            batch_size=cfg.rollout.batch_size,
            precision=cfg.train.precision,
            view=view,
            packed_weights=cfg.rollout.packed_weights,
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
