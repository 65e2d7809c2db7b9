"""Faster CPU decoding: sample through oneDNN-packed copies of the linear weights.

A decode step multiplies a few rows (the batch's sequences) by every weight matrix. torch's
fp32 matmul on CPU goes to MKL's sgemm, which for such skinny products runs far below the
memory bandwidth (and, on AMD CPUs, on generic kernels); oneDNN's inner-product primitive on a
weight reordered once into its blocked layout is several times faster for 8-64 rows
(docs/vs-trl.md has the measurements). It is the same kernel torch.compile uses on CPU for
frozen linears.

The packed copies are made when generation starts (a 135M model: ~0.1-0.3 s, one extra copy
of the weights) and dropped after, so they always hold the weights the trainer just updated.
Results equal torch's matmul to float rounding (the reduction order differs); the trainer
recomputes log-probs with its own kernels, and the gap is logged as `logprob_gap`.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def packing_available() -> bool:
    """oneDNN is built in and has the packed-linear ops (torch CPU builds since 2.1)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(module: torch.nn.Module) -> bool:
    """A plain fp32 CPU nn.Linear (not a sharded DTensor, not a quantized or offloaded layer)."""
    w = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and type(w) is torch.nn.Parameter
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.dim() == 2
    )


def _packed_linear(module: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):  # leave those to torch
        return torch.nn.functional.linear(x, module.weight, module.bias)
    bias = None if module.bias is None else module.bias.detach()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int = 64):
    """While inside, every packable nn.Linear of `model` runs on a packed copy of its weight
    (no autograd: use under torch.no_grad). `rows` is the expected batch of rows, a layout
    hint only. The modules are restored on exit, also on error."""
    patched: list[torch.nn.Module] = []
    try:
        if packing_available():
            with torch.no_grad():
                for m in model.modules():
                    if packable(m) and "forward" not in m.__dict__:  # not packed already (nested use)
                        packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows)
                        m.forward = functools.partial(_packed_linear, m, packed)  # shadows the class's forward
                        patched.append(m)
        yield len(patched)
    finally:
        for m in patched:
            del m.forward
