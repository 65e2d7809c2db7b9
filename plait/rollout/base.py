"""The engine interface every generation backend implements: the HF engine in the training
process (hf.py), colocated vLLM (vllm_engine.py), and the engines outside it that RemoteEngine
(remote.py) talks to: `plait rollout-server` replicas and the HF engine's generation process.
Rollout programs (plait/programs: the tool loop, rollout_func, agents) sample through any of
them; nothing wraps an engine."""

from __future__ import annotations

from typing import ContextManager, Protocol

import torch

from plait.types import Completion, Prompt, SamplingParams


class RolloutEngine(Protocol):
    pad_id: int

    def weights_for_round(self, version: int) -> ContextManager:
        """Make the engine sample from the trainer's weights after `version` rounds (the weight
        version: a round's updates, one or several optimizer steps, make one), for the duration
        of the returned context. Every training process calls it (sharded backends
        gather weights collectively). The HF engine gathers them for the context; vLLM engines
        copy them in once per version and return an empty context."""

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order; deterministic for a given params.seed."""

    def stats(self) -> dict[str, float]:
        """Metrics of the weight sync done by the last `weights_for_round` call (e.g.
        weight_sync/gb, weight_sync/seconds_per_gb), to log with the step; {} when it copied
        nothing or the engine measures nothing."""

    def health(self) -> dict:
        """Whether the engine can generate, and what it holds: {"engine", "version", ...}. An
        engine outside this process asks it (RemoteEngine: every replica's /health) and raises
        RolloutServerError when one is dead."""

    def close(self) -> None:
        """Free the engine's resources."""


class PushedEngine(RolloutEngine, Protocol):
    """An engine outside the training process (RemoteEngine): the asynchronous producer sends it
    each weight version itself."""

    def push_weights(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Make the engine hold `weights` (checkpoint names, full tensors) as version `version`."""
