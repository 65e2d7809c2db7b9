"""AdamW and the LR schedule (linear warmup, the peak, then constant / linear / cosine decay to min_lr_ratio)."""

from __future__ import annotations

import contextlib
import math

import torch


def lr_factor(step: int, warmup: int, total: int, kind: str, floor: float = 0.0, decay_ratio: float = 1.0) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): a linear warmup over `warmup`
    steps, then the peak, then linear or cosine decay from 1 to `floor` over the last `decay_ratio`
    of the steps after warmup (warmup-stable-decay; 1 = every step after warmup, transformers'
    cosine_with_min_lr with min_lr_rate = floor)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    start = warmup + (total - warmup) * (1.0 - decay_ratio)
    if kind == "constant" or step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, total - start))
    decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * decay


def can_fuse(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW: one kernel over all tensors instead of a Python loop of small ops.
    Plain floating tensors on CPU or CUDA only; sharded (DTensor) and DeepSpeed's flat
    partitions keep the default."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        type(p) is torch.nn.Parameter
        and not isinstance(p, DTensor)
        and p.device.type in ("cpu", "cuda")
        and p.is_floating_point()
        for p in params
    )


def make_optimizer(model, cfg, fused: bool = True) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.weight_decay,
        fused=True if fused and can_fuse(params) else None,
    )
    total = cfg.optimizer_updates
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, t.warmup_steps, total, t.lr_scheduler, t.min_lr_ratio, t.decay_ratio)
    )
    return opt, sched


@contextlib.contextmanager
def scaled_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, scale: float):
    """The optimizer step inside runs at `scale` x the schedule's learning rate. Afterwards the
    rates are the schedule's again (its last ones: LambdaLR sets them from its base rates when
    it steps, so a step inside moves the schedule on as usual)."""
    groups = scheduler.optimizer.param_groups
    for g in groups:
        g["lr"] *= scale
    try:
        yield
    finally:
        for g, lr in zip(groups, scheduler.get_last_lr()):
            g["lr"] = lr
