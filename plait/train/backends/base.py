"""What the training loop asks of a backend: the `Backend` protocol.

A backend decides how the processes of one job hold the model and share the work (one process,
replicated weights, FSDP2 shards, ZeRO partitions). The loop only calls the methods below and
reads the capability attributes; it never asks which backend it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Protocol

import torch


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer update did. `grad_norm` is the pre-clip norm (the same in every
    process); a non-finite one means the update was skipped: weights, optimizer state and LR
    schedule untouched. `lr` is the learning rate the update used (or would have)."""

    applied: bool
    grad_norm: float
    lr: float
    reference_synced: bool = False


class Backend(Protocol):
    name: str
    device: torch.device
    model: torch.nn.Module  # forward with gradients (wrapped by DDP / DeepSpeed where they wrap)
    module: torch.nn.Module  # the plain HF model: no-grad forwards, generation, export
    ref_model: torch.nn.Module | None  # frozen reference (None: beta = 0, or LoRA's base model)
    teacher_model: torch.nn.Module | None  # frozen teacher held here (None: no teacher, or one in its own process)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # saved in checkpoints; stepped by `step()`

    # capabilities
    shares_prompt_pass: bool  # a group's prompt may go through the model once for all its completions
    async_save: bool  # `save_state_async` copies the state and writes it in the background

    def load(self, cfg) -> None:
        """Model (+ reference) + optimizer + LR schedule, placed and wrapped as the backend does it."""

    def describe(self) -> dict:
        """What this process holds (params_local, params_total, ...), for the run log."""

    def autocast(self) -> ContextManager:
        """Mixed precision around forward passes."""

    def keep_casts(self) -> ContextManager:
        """Around one update's micro-batches (its weights do not change inside): mixed
        precision's casts of them kept from one micro-batch to the next, where that is safe."""

    def accumulate(self, last: bool) -> ContextManager:
        """Context around one micro-batch's forward and backward; `last` ends the update (gradients sync then)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (normalized by the whole update's counts over all processes)."""

    def step(self, max_norm: float | None) -> StepOutcome:
        """Clip, apply the update unless the norm is non-finite (the skip rule), clear the
        gradients, advance the LR schedule and sync the reference model when due."""

    def for_generation(self) -> ContextManager[torch.nn.Module]:
        """A re-entrant context yielding a module with full weights to sample from."""

    def save_state(self, folder: Path) -> None: ...

    def save_state_async(self, folder: Path) -> Callable[[], None]:
        """Copy the state now; the returned function writes it (only where `async_save`)."""

    def load_state(self, folder: Path) -> None: ...

    def export(self, path: Path, tokenizer) -> None:
        """A plain Hugging Face model folder (LoRA merged)."""
