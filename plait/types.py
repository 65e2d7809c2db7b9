"""The data contract between the stages of a GRPO step.

prompts -> rollout -> rewards -> advantages -> policy update. Every value that crosses a
stage boundary is one of these plain dataclasses, so each stage can be tested alone with
hand-made inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Prompt:
    """One dataset row, ready to generate from.

    `text` is the prompt after the chat template was applied; `token_ids` its tokens.
    `answer` is the reference answer (if the task has one) and `columns` every other dataset
    column, passed by name to reward functions.
    """

    index: int
    text: str
    token_ids: list[int]
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """How the rollout engine samples. temperature=0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    `logprobs[i]` is the log-probability the engine gave `token_ids[i]` under the
    temperature-scaled distribution (the same one the trainer computes), so the trainer can
    measure how far the engine's numbers are from its own.
    """

    prompt_index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    truncated: bool
    finish_reason: str  # "eos" | "stop" | "length"
    # optimizer steps applied to the weights that sampled it (engines with a copy of the
    # weights report it; None: sampled from the trainer's live weights)
    weight_version: int | None = None


@dataclass
class Group:
    """A prompt with its `num_generations` completions and their rewards.

    `rewards[f][j]` is reward function f's score for completion j (NaN-free by the time a
    Group exists; the reward runner checks). `total` is the weighted sum per completion.
    """

    prompt: Prompt
    completions: list[Completion]
    rewards: dict[str, list[float]] = field(default_factory=dict)
    total: list[float] = field(default_factory=list)


@dataclass
class Batch:
    """Tensors for one policy update, right-padded completions after left-padded prompts.

    input_ids, attention_mask: [B, T] with T = prompt_len + completion_len.
    completion_mask: [B, C] which completion positions are real tokens that count in the loss.
    advantages: [B] one scalar per completion, broadcast over its tokens.
    old_logprobs / ref_logprobs / sampling_logprobs: [B, C] or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    prompt_len: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "Batch":
        """The same batch with every tensor on `device`."""

        def mv(t):
            return None if t is None else t.to(device)

        return Batch(
            mv(self.input_ids), mv(self.attention_mask), mv(self.completion_mask), mv(self.advantages),
            self.prompt_len, mv(self.old_logprobs), mv(self.ref_logprobs), mv(self.sampling_logprobs),
        )

    def slice(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) as a new Batch (a micro-batch)."""

        def cut(t):
            return None if t is None else t[start:stop]

        return Batch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            completion_mask=self.completion_mask[start:stop],
            advantages=self.advantages[start:stop],
            prompt_len=self.prompt_len,
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            sampling_logprobs=cut(self.sampling_logprobs),
        )
