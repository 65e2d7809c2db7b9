"""Fewer kernels per decoding step: transformers' RMSNorm as torch's fused one.

A decoding step of a small model on a GPU is bound by the number of kernels it launches, not by
its arithmetic (rollout/graphs.py: SmolLM2-135M's step reads its weights in ~0.1 ms on an H200
and replays its captured kernels in ~3 ms). transformers' Llama-family RMSNorm is six of them
per call (a square, a mean, an add, an rsqrt, two products), twice per layer; torch's
`F.rms_norm` is one kernel on a GPU. On a CPU it saves the same operator calls.

Only norms whose forward is transformers' Llama RMSNorm, source for source (Qwen2, Qwen3,
Mistral, Phi-3 and others copy it), are swapped: Gemma's scales by 1 + weight, OLMo-2's rounds
in another order, and any class not known stays as it is. In fp32 the fused norm computes the
same products to float rounding (the mean's summation order may differ); the trainer
recomputes the log-probs with its own modules, and the gap is logged (`logprob_gap`).
"""

from __future__ import annotations

import functools
import inspect
import textwrap

import torch
import torch.nn.functional as F

from plait.rollout.packed import swapped


@functools.cache
def _source(cls) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None


@functools.cache
def llama_rms_norm(cls) -> bool:
    """`cls.forward` is transformers' LlamaRMSNorm.forward, word for word."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return False
    return cls is LlamaRMSNorm or (_source(cls) is not None and _source(cls) == _source(LlamaRMSNorm))


def _applies(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        isinstance(w, torch.nn.Parameter)
        and w.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and llama_rms_norm(type(module))
    )


def _fused_rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps, w = module.variance_epsilon, module.weight
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    # transformers' order: normalise in fp32, round to the input's dtype, then scale
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused_norms(model: torch.nn.Module):
    """While inside, every Llama-form RMSNorm of `model` runs torch's fused rms_norm (restored
    on exit, also on error); yields how many were swapped."""
    return swapped(model, _applies, _fused_rms_norm)
