"""Model FLOPs and the device's peak, for model FLOPs utilization (MFU).

MFU = the FLOPs the model needs for the tokens it processed / (time x peak FLOP/s). Only
useful work counts (real tokens, not padding; a group's prompt computed once, and the
beginning every prompt of a round shares once, in generation and in training), so MFU falls
when plait wastes compute, which is what it is for.

Per real token of a sequence of length T, a forward pass costs 2N + 4*L*d*T FLOPs (the matmul
weights, N, and attention scores/values, as in PaLM's appendix B); training adds the backward
pass: 2N for the activation gradients, 2 x trainable for the weight gradients (so LoRA's
frozen base costs 4N, not 6N) and twice the attention. The input embedding is a lookup, not a
matmul: it counts only when it is tied to the output head.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.models import text_config


@dataclass(frozen=True)
class ModelCost:
    matmul_params: int  # N: weights used as matmuls per token
    trainable: int  # weights that get gradients
    layers: int
    attn_width: int  # heads x head_dim
    head_params: int = 0  # the output head (vocab x hidden), part of N: needed only where a token is predicted

    def forward(self, lengths: list[int]) -> float:
        """FLOPs of one forward pass over sequences of these real lengths."""
        return float(sum(t * (2 * self.matmul_params + 4 * self.layers * self.attn_width * t) for t in lengths))

    def train(self, lengths: list[int]) -> float:
        """FLOPs of forward + backward (activation and weight gradients)."""
        fwd_attn = sum(4 * self.layers * self.attn_width * t * t for t in lengths)
        n = float(sum(lengths))
        return n * (4 * self.matmul_params + 2 * self.trainable) + 3.0 * fwd_attn

    def _group_attention(
        self, prompt_lengths: list[int], completion_lengths: list[list[int]], shared: int = 0
    ) -> float:
        """Forward attention FLOPs of groups whose prompt is computed once: the prompt's tokens
        over the prompt, each completion's tokens over its whole sequence; the `shared` first
        tokens of every prompt (the same in all) once for all groups."""
        per = 4 * self.layers * self.attn_width
        repeated = per * shared * shared * max(0, len(prompt_lengths) - 1)
        return float(
            sum(per * p * p + sum(per * c * (p + c) for c in cs) for p, cs in zip(prompt_lengths, completion_lengths))
            - repeated
        )

    def _group_tokens(
        self, prompt_lengths: list[int], completion_lengths: list[list[int]], shared: int = 0
    ) -> tuple[int, int]:
        """(tokens through the body, tokens through the output head): the head only where a
        completion token is predicted (the last prompt position predicts the first)."""
        completions = sum(sum(cs) for cs in completion_lengths)
        prompts = sum(prompt_lengths) - shared * max(0, len(prompt_lengths) - 1)
        return prompts + completions, completions

    def forward_groups(self, prompt_lengths: list[int], completion_lengths: list[list[int]], shared: int = 0) -> float:
        """A forward pass over groups (prompt once + its completions; the prompts' `shared`
        beginning once for all): the useful work of a log-prob pass, whether or not the prompt
        is shared in practice."""
        body, head = self._group_tokens(prompt_lengths, completion_lengths, shared)
        weights = body * (self.matmul_params - self.head_params) + head * self.head_params
        return 2.0 * weights + self._group_attention(prompt_lengths, completion_lengths, shared)

    def train_groups(self, prompt_lengths: list[int], completion_lengths: list[list[int]], shared: int = 0) -> float:
        """Forward + backward over groups (prompt once + its completions; the prompts' `shared`
        beginning once for all)."""
        body, head = self._group_tokens(prompt_lengths, completion_lengths, shared)
        frozen_share = 1.0 - self.trainable / max(1, self.matmul_params)  # weight gradients only for trainable weights
        per_weight = 6.0 - 2.0 * frozen_share
        weights = body * (self.matmul_params - self.head_params) + head * self.head_params
        return per_weight * weights + 3 * self._group_attention(prompt_lengths, completion_lengths, shared)

    def generate(self, prompt_lengths: list[int], completion_lengths: list[list[int]], shared: int = 0) -> float:
        """Sampling groups: each prompt prefilled once (the output head only at its last
        position, which gives every completion's first token; the prompts' `shared` beginning
        once for all), then each later token decoded against its context (prompt + the tokens
        before it)."""
        per = 4 * self.layers * self.attn_width
        body = self.matmul_params - self.head_params
        flops = -float(max(0, len(prompt_lengths) - 1) * shared * (2 * body + per * shared))
        for p, lengths in zip(prompt_lengths, completion_lengths):
            flops += p * (2 * body + per * p) + 2 * self.head_params
            for c in lengths:  # decode steps i = 1 .. c-1 feed token i, which attends to p + i positions
                flops += (c - 1) * 2 * self.matmul_params + per * sum(p + i for i in range(1, c))
        return flops


def model_cost(hf_config, params_total: int, trainable: int) -> ModelCost:
    """The cost model of a transformers model from its config and parameter counts."""
    text = text_config(hf_config)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0))
    tied = bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    lookup_only = 0 if tied else vocab * hidden  # an untied input embedding is never multiplied
    return ModelCost(
        matmul_params=max(0, params_total - lookup_only),
        trainable=min(trainable, params_total),
        layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        attn_width=heads * head_dim,
        head_params=vocab * hidden,
    )


# ---------------------------------------------------------------- the peak

# Dense (no sparsity) peak FLOP/s from the vendors' datasheets: (bf16/fp16 tensor, fp32).
# fp32 here is plain fp32 (torch does not use TF32 for matmuls unless told to).
GPU_PEAKS: list[tuple[str, float, float]] = [
    ("GB200", 2.5e15, 80e12),
    ("B200", 2.25e15, 80e12),
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),  # SXM; NVL reports itself with its own name below
    ("H800", 989e12, 67e12),
    ("H20", 148e12, 44e12),
    ("A100", 312e12, 19.5e12),
    ("A800", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
    ("A10", 125e12, 31.2e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("RTX 3090", 71e12, 35.6e12),
    ("V100", 125e12, 15.7e12),
    ("T4", 65e12, 8.1e12),
]


def gpu_peak(name: str, precision: str) -> float | None:
    for key, bf16, fp32 in GPU_PEAKS:
        if key in name:
            return bf16 if precision == "bf16" else fp32
    return None


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait" / "peak_flops.json"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


KERNEL_CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def _kernel_caps() -> str:
    """The environment variables that pick other matmul kernels (train.deterministic sets them):
    part of the cache key, so a capped run's peak is not taken for the CPU's."""
    caps = [f"{k}={os.environ[k]}" for k in KERNEL_CAP_VARIABLES if os.environ.get(k)]
    return "|" + ",".join(caps) if caps else ""


def measure_cpu_peak(
    dtype: torch.dtype, threads: int, sizes: tuple[int, ...] = (256, 512, 1024, 2048), repeats: int = 3, budget_s=0.05
) -> tuple[float, int]:
    """(the best FLOP/s of a square matmul on this CPU with `threads` threads, the largest size
    measured): what the CPU's vector units reach in practice (the datasheet peak of a CPU
    depends on clocks and instruction mix no one publishes per core count). The size grows
    until one matmul takes longer than `budget_s`: a dtype the CPU has no kernels for (bf16
    without AVX512_BF16 reaches ~0.2 GFLOP/s on an AVX2-only EPYC) would otherwise spend minutes
    on the 2048 matmuls a fast one finishes in a tenth of a second."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rate, size = 0.0, sizes[0]
    try:
        for size in sizes:
            a = torch.randn(size, size).to(dtype)
            b = torch.randn(size, size).to(dtype)
            a @ b  # warm-up: thread pool, kernel selection
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            rate = max(rate, 2.0 * size**3 / best)
            if best > budget_s:
                break
        return rate, size
    finally:
        torch.set_num_threads(before)


def cpu_peak(precision: str) -> float:
    """The measured peak for this CPU, thread count, dtype and torch version, cached on disk
    (a second or so the first time)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    threads = torch.get_num_threads()
    key = f"{_cpu_name()}|{threads} threads|{dtype}|torch {torch.__version__}{_kernel_caps()}"
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_cpu_peak(dtype, threads)[0]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measure again next time
    return cache[key]


def device_peak(device: torch.device, precision: str, override: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one training device, where the number comes from)."""
    if override:
        return override, "log.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, precision)
        return peak, f"{name} datasheet ({precision})" if peak else f"{name}: not in plait's table (set log.peak_flops)"
    if device.type == "cpu":
        return cpu_peak(precision), f"measured {precision} matmul, {torch.get_num_threads()} thread(s)"
    return None, f"{device.type}: no known peak (set log.peak_flops)"
