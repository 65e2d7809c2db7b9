"""Rollout engines: turn prompts into groups of completions. See base.RolloutEngine."""

from plait.rollout.base import RolloutEngine
from plait.rollout.hf import HFEngine

__all__ = ["RolloutEngine", "HFEngine", "make_engine"]


def make_engine(cfg, model, tokenizer, view=None) -> RolloutEngine:
    """The engine named by `cfg.rollout.engine` (later issues add vLLM here). `view` is the
    training backend's context that yields full weights to sample from."""
    if cfg.rollout.engine == "hf":
        return HFEngine(model, tokenizer, batch_size=cfg.rollout.batch_size, precision=cfg.train.precision, view=view)
    raise ValueError(f"unknown rollout engine {cfg.rollout.engine!r}")
