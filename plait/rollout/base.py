"""The engine interface every generation backend implements (transformers, vLLM colocated,
vLLM servers)."""

from __future__ import annotations

from typing import ContextManager, Protocol

from plait.types import Completion, Prompt, SamplingParams


def pad_id_of(tokenizer) -> int:
    """The id completions are padded with: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class RolloutEngine(Protocol):
    pad_id: int

    def weights_for_step(self, version: int) -> ContextManager:
        """Make the engine sample from the trainer's weights after `version` optimizer steps, for
        the duration of the returned context. Every training process calls it (sharded backends
        gather weights collectively). The HF engine gathers them for the context; vLLM engines
        copy them in once per version and return an empty context."""

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order; deterministic for a given params.seed."""

    def close(self) -> None:
        """Free the engine's resources."""
