"""Training backends: how the processes of one job hold the model and share the work.

local (one process), ddp (replicated weights, all-reduced gradients), fsdp2 (sharded weights,
gradients and optimizer state), deepspeed (ZeRO 2/3). Each implements the `Backend` protocol
of base.py; the loop reads only that protocol and its capability attributes.
"""

from __future__ import annotations

import os

import torch

from plait.train.backends.base import Backend, StepOutcome
from plait.train.backends.local import DDPBackend, LocalBackend


if not torch.cuda.is_available():  # DeepSpeed (imported by transformers too) warns when it has to guess
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, cfg, device: torch.device) -> Backend:
    """The backend called `name` (already resolved from 'auto'); joins the process group."""
    from plait import comm

    if name != "local":
        comm.init_from_env(device, single_process_ok=True)
    if name == "local":
        return LocalBackend(cfg, device)
    if name == "ddp":
        return DDPBackend(cfg, device)
    if name == "fsdp2":
        from plait.train.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(cfg, device)
    if name == "deepspeed":
        from plait.train.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(cfg, device)
    raise ValueError(f"unknown backend {name!r}")


__all__ = ["Backend", "StepOutcome", "LocalBackend", "DDPBackend", "make_backend", "resolve_device"]
