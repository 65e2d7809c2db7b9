"""Rollout engines: turn prompts into groups of completions. See base.RolloutEngine."""

from plait.rollout.base import RolloutEngine
from plait.rollout.hf import HFEngine

__all__ = ["RolloutEngine", "HFEngine", "make_engine"]


def make_engine(cfg, model, tokenizer) -> RolloutEngine:
    """The engine named by `cfg.rollout.engine` (later issues add vLLM here)."""
    if cfg.rollout.engine == "hf":
        return HFEngine(model, tokenizer, batch_size=cfg.rollout.batch_size, precision=cfg.train.precision)
    raise ValueError(f"unknown rollout engine {cfg.rollout.engine!r}")
