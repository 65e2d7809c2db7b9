"""How one process computes and applies gradients. `LocalBackend` is the single-process one;
distributed backends (DDP, FSDP2, DeepSpeed) implement the same few methods."""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LocalBackend:
    rank = 0
    world_size = 1

    def __init__(self, precision: str = "fp32", device: str | torch.device = "cpu"):
        self.precision = precision
        self.device = torch.device(device)

    def autocast(self):
        """Mixed precision for forward passes (bf16 on CPU uses AMX where the CPU has it)."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum numbers over processes (identity here)."""
        return list(values)

    def clip_and_step(self, model, optimizer, max_norm: float | None) -> float:
        """Clip the gradient norm, take the optimizer step, and return the pre-clip norm."""
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)
