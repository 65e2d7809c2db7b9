"""How fast a decode step could be: the roofline of one token for every row of a batch.

A decode step reads every weight the forward pass multiplies (an untied input embedding only
gathers `rows` rows, so it is left out) plus each layer's cached keys and values, and does
2 FLOPs per weight per row plus the attention over the context. Its lower bound is the larger
of bytes / memory bandwidth and FLOPs / peak FLOP/s. On a CPU the bandwidth is measured here
(a sum over a buffer much larger than the caches); on a GPU it is the datasheet figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from plait.models import text_config


# HBM bandwidth in bytes/s from the vendors' datasheets. Order matters: the first key found in
# the device's name wins, so the specific names come before the general ones.
GPU_BANDWIDTH: list[tuple[str, float]] = [
    ("GB200", 8.0e12),
    ("B200", 8.0e12),
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM (reports itself as "H100 80GB HBM3")
    ("H800", 3.35e12),
    ("H20", 4.0e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100", 2.039e12),  # the 80 GB parts
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("A10", 0.6e12),
    ("RTX 4090", 1.008e12),
    ("RTX 3090", 0.936e12),
    ("V100", 0.9e12),
    ("T4", 0.32e12),
]


def gpu_bandwidth(name: str) -> float | None:
    for key, bw in GPU_BANDWIDTH:
        if key in name:
            return bw
    return None


def measure_cpu_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Best read bandwidth (bytes/s) of a float32 sum over `megabytes` with torch's threads: what
    streaming the weights can reach on this machine at best."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def device_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """(bytes/s, where the number comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        bw = gpu_bandwidth(name)
        return bw, f"{name} datasheet" if bw else f"{name}: not in plait's table"
    return measure_cpu_bandwidth(), f"measured (float32 sum, {torch.get_num_threads()} threads)"


@dataclass(frozen=True)
class DecodeCost:
    weight_bytes: int  # read once per step, whatever the number of rows
    matmul_params: int
    kv_bytes_per_position: int  # keys + values of one position of one row, all layers
    attn_flops_per_position: int  # scores + weighted values of one query over one position

    def bytes(self, rows: int, context: int) -> float:
        return float(self.weight_bytes + rows * context * self.kv_bytes_per_position)

    def flops(self, rows: int, context: int) -> float:
        return float(rows * (2 * self.matmul_params + context * self.attn_flops_per_position))

    def bound(self, rows: int, context: int, bandwidth: float, peak: float | None) -> tuple[float, str]:
        """(seconds, "memory" or "compute"): the roofline of one decode step."""
        mem = self.bytes(rows, context) / bandwidth
        compute = self.flops(rows, context) / peak if peak else 0.0
        return (mem, "memory") if mem >= compute else (compute, "compute")


def decode_cost(model: torch.nn.Module, kv_dtype: torch.dtype | None = None) -> DecodeCost:
    """The decode roofline's inputs for a transformers causal LM as it is loaded (its dtypes)."""
    text = text_config(model.config)
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():  # tied weights once
        seen.setdefault(p.data_ptr(), p)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    weights = [p for p in seen.values() if tied or p.data_ptr() != emb.data_ptr()]
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", 0) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    layers = int(text.num_hidden_layers)
    kv_item = torch.empty((), dtype=kv_dtype or next(model.parameters()).dtype).element_size()
    return DecodeCost(
        weight_bytes=sum(p.numel() * p.element_size() for p in weights),
        matmul_params=sum(p.numel() for p in weights),
        kv_bytes_per_position=2 * layers * kv_heads * head_dim * kv_item,
        attn_flops_per_position=4 * layers * heads * head_dim,
    )
