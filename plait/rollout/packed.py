"""Faster CPU decoding: sample through packed copies of the linear weights, fp32 (oneDNN) or
int8 (fbgemm), made when a round's generation starts.

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

int8 (rollout.precision=int8): each linear's weight is rounded to int8 with one scale per output
row, and each call quantizes its input per tensor on the fly (dynamic quantization), then
multiplies in int8 with int32 sums through fbgemm, torch's x86 kernels. On a 2-core Zen 5 one
SmolLM2-135M MLP projection at 64 rows took 0.09 ms this way, 0.63 ms in fp32 and 0.31 ms with
torchao's Int8DynamicActivationInt8Weight in eager mode (torch._int_mm; 0.22 vs 0.02 ms at 8
rows), so fbgemm it is. The output head stays fp32 (packed): its rounding would move every
logit. The sampled tokens then come from a slightly different policy than the trainer's; the
trainer recomputes the old log-probs in full precision and algo.engine_is_correction weighs
the gap (docs/vs-trl.md has the measurements).

Attention: a decoding step of a model whose query heads share key/value heads goes through
grouped_attention_forward, which multiplies each shared head once; transformers' sdpa path
copies them out per query head whenever a mask is given (bench/decode_attention.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from plait.models import cpu_flags
from plait.rollout import prefix


def packing_available() -> bool:
    """oneDNN is built in and has the packed-linear ops (torch CPU builds since 2.1)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(module: torch.nn.Module, dtypes=(torch.float32,), device: str = "cpu") -> bool:
    """A plain nn.Linear on `device` with weights of one of `dtypes` (not a sharded DTensor, not
    a quantized or offloaded layer)."""
    w = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and type(w) is torch.nn.Parameter
        and w.dtype in dtypes
        and w.device.type == device
        and w.dim() == 2
    )


def _packed_linear(module: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):  # leave those to torch
        return torch.nn.functional.linear(x, module.weight, module.bias)
    bias = None if module.bias is None else module.bias.detach()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def int8_available() -> bool:
    """torch has its fbgemm int8 kernels (x86 CPU builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def int8_full_range() -> bool:
    """fbgemm can multiply full-range (8-bit) activations here: the CPU has VNNI. Without it,
    fbgemm's AVX2 kernels add pairs of u8 x s8 products in int16, which full-range activations
    can saturate, so plait quantizes them to 7 bits (about twice the rounding error)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


def _int8_pack(module: torch.nn.Linear):
    """fbgemm's packed int8 copy of the weight: symmetric, one scale per output row."""
    w = module.weight.detach()
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    q = torch.round(w / scale).to(torch.int8)
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor types deprecated (for torchao)
        qw = torch._make_per_channel_quantized_tensor(q, scale.squeeze(1).double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qw, None if module.bias is None else module.bias.detach())


def _int8_linear(module: torch.nn.Linear, packed, x: torch.Tensor, reduce_range: bool) -> torch.Tensor:
    if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


def _onednn_pack(rows: int, module: torch.nn.Linear):
    return torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)


def bf16_packing_available() -> bool:
    """oneDNN can multiply bf16 here: natively with AVX512_BF16/AMX, emulated (slower than
    fp32) on other AVX-512 CPUs; torch refuses it on AVX2-only ones."""
    return packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bf16_pack(rows: int, module: torch.nn.Linear):
    return torch.ops.mkldnn._reorder_linear_weight(module.weight.detach().to(torch.bfloat16), rows)


def _bf16_linear(module: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16) or torch.is_autocast_enabled("cpu"):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").to(x.dtype)
    return out if module.bias is None else out + module.bias.detach()


@contextlib.contextmanager
def swapped(model: torch.nn.Module, applies, forward, pack=None):
    """Every module of `model` for which `applies(module)` holds and that is not swapped already
    (nested use) runs `forward(module, pack(module))` (`forward(module)` without `pack`) while
    inside; restored on exit, also on error."""
    patched: list[torch.nn.Module] = []
    try:
        with torch.no_grad():
            for m in model.modules():
                if "forward" not in m.__dict__ and applies(m):
                    # shadows the class's forward
                    m.forward = functools.partial(forward, m, pack(m)) if pack else functools.partial(forward, m)
                    patched.append(m)
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


def _swapped(model: torch.nn.Module, pack, forward, skip=(), dtypes=(torch.float32,), device: str = "cpu"):
    """swapped() for the packable nn.Linear modules of `model` not in `skip`."""
    return swapped(model, lambda m: packable(m, dtypes, device) and not any(m is k for k in skip), forward, pack)


def packed_linears(model: torch.nn.Module, rows: int = 64):
    """While inside, every packable nn.Linear of `model` runs on a packed copy of its weight
    (no autograd: use under torch.no_grad). `rows` is the expected batch of rows, a layout
    hint only. The modules are restored on exit, also on error."""
    if not packing_available():
        return contextlib.nullcontext(0)
    return _swapped(model, functools.partial(_onednn_pack, rows), _packed_linear)


def bf16_linears(model: torch.nn.Module, rows: int = 64):
    """While inside, every packable fp32 or bf16 nn.Linear of `model` multiplies in bf16
    (oneDNN-packed bf16 copies of the weights, each input rounded to bf16, fp32 sums, the product
    rounded to bf16) and hands on the input's dtype: in an fp32 model, norms, attention, the
    residual stream and the sampling stay fp32. bf16 autocast instead casts every weight again at
    each forward pass."""
    if not bf16_packing_available():
        raise RuntimeError("this CPU or torch build cannot pack bf16 weights: use bf16 autocast")
    return _swapped(model, functools.partial(_bf16_pack, rows), _bf16_linear, dtypes=(torch.float32, torch.bfloat16))


def _copy_linear(module: torch.nn.Linear, copy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_autocast_enabled(x.device.type):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return torch.nn.functional.linear(x, copy, module.bias)  # autocast rounds x (and a bias) to bf16


class Bf16Copies:
    """bf16 copies of a GPU model's fp32 linear weights, for sampling under bf16 autocast.

    Autocast rounds every fp32 weight to bf16 again at each forward pass: one extra kernel per
    linear and a read of the fp32 weight per decoding step, also inside a captured CUDA graph,
    which replays the casts it recorded. Here each weight is rounded once per generate call,
    into a copy that lives as long as the engine: its address stays put, so a graph captured
    over it stays valid, and `refresh` writes the trainer's new weights into it in place. The
    products are autocast's own (the same rounding of the same weight, the same bf16 matmul);
    the memory is half the linears' fp32 weights more."""

    def __init__(self):
        self.copies: dict[torch.nn.Module, torch.Tensor] = {}

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the modules' current weights into their copies (in place): weights that moved
        mid-call (an in-flight update)."""
        for m, copy in self.copies.items():
            if copy.shape == m.weight.shape:
                copy.copy_(m.weight)

    def _copy(self, module: torch.nn.Linear) -> torch.Tensor:
        copy = self.copies.get(module)
        if copy is None or copy.shape != module.weight.shape or copy.device != module.weight.device:
            copy = self.copies[module] = torch.empty_like(module.weight, dtype=torch.bfloat16)
        return copy.copy_(module.weight)

    def linears(self, model: torch.nn.Module):
        """While inside, every fp32 nn.Linear of `model` on its GPU multiplies its bf16 copy."""
        device = next(model.parameters()).device.type
        return _swapped(model, self._copy, _copy_linear, device=device)


def int8_linears(model: torch.nn.Module):
    """While inside, every packable nn.Linear of `model` but its output head multiplies in int8
    (see the module's docstring); nest packed_linears inside for the head."""
    if not int8_available():
        raise RuntimeError(
            "rollout.precision=int8 needs torch's fbgemm kernels (x86 CPU builds); this torch has "
            f"{torch.backends.quantized.supported_engines}: use rollout.precision=fp32"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    forward = functools.partial(_int8_linear, reduce_range=not int8_full_range())
    return _swapped(model, _int8_pack, forward, skip=[head] if head is not None else [])


GROUPED = "plait_grouped_sdpa"


def grouped_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, but a decoding step (one query per row) of a model whose
    query heads share key/value heads (GQA) multiplies each shared head once. transformers'
    own sdpa path copies every shared key/value head per query head (`repeat_kv`) whenever a
    mask is given, as it always is for a left-padded batch: with the growing cache that copy
    was a quarter of a demo generation call on CPU (aten::copy_). Prefill goes to sdpa as is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared_prefix = prefix.attention(module, query, key, value, scaling, kwargs)
    if shared_prefix is not None:
        return shared_prefix, None
    b, heads, q_len, dim = query.shape
    shared = key.shape[1]
    if q_len != 1 or heads == shared or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    q = query.view(b, shared, heads // shared, dim)  # [b, kv heads, queries per kv head, dim]
    scores = torch.matmul(q, key.transpose(-1, -2)) * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, :]  # [b, 1, 1, L]: the last query's row
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.float().softmax(-1).to(value.dtype), value).view(b, heads, 1, dim)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_grouped() -> None:
    """Make GROUPED a name transformers' models accept: its attention, and sdpa's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GROUPED, grouped_attention_forward)
    AttentionMaskInterface.register(GROUPED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def grouped_attention(model):
    """Decode through grouped_attention_forward where the model runs transformers' sdpa."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register_grouped()
    config._attn_implementation = GROUPED
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
