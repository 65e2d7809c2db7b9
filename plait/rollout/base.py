"""The engine interface every generation backend implements (transformers now, vLLM later)."""

from __future__ import annotations

from typing import Protocol

from plait.types import Completion, Prompt, SamplingParams


class RolloutEngine(Protocol):
    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order; deterministic for a given params.seed."""

    def update_weights(self, model) -> None:
        """Make the engine sample from `model`'s current weights (a no-op when it shares them)."""
