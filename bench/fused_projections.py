"""Would fusing a decoder layer's projections pay on CPU? One layer's q, k, v, gate and up
projections of SmolLM2-135M's shapes (576 -> 576, 192, 192, 1536, 1536) as five oneDNN-packed
products, against two (q|k|v and gate|up stacked, as vLLM's QKVParallelLinear and
MergedColumnParallelLinear do), in fp32 and in bf16 (plait's rollout.precision=bf16 path: input
rounded to bf16, bf16 packed weights, output back to fp32). Random weights: speed only.

    .venv/bin/python bench/fused_projections.py [--rows 64 8] [--calls 400]

Prints milliseconds per layer's set of products, the mean of --calls after 50 warm-up calls.
Say which CPU ran it (`lscpu`); bf16 needs a CPU oneDNN can run bf16 on.
"""

from __future__ import annotations

import argparse
import time

import torch


OUT = {"q": 576, "k": 192, "v": 192, "gate": 1536, "up": 1536}
HIDDEN = 576


def pack(w: torch.Tensor, rows: int, bf16: bool) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16) if bf16 else w, rows)


def product(x: torch.Tensor, packed: torch.Tensor, bf16: bool) -> torch.Tensor:
    if bf16:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").float()
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def ms_per_call(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {name: torch.randn(n, HIDDEN) for name, n in OUT.items()}
    kinds = [False, True] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [False]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| rows | precision | 5 products ms | 2 fused ms | fused / separate |\n|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN)
        for bf16 in kinds:
            apart = [pack(w, rows, bf16) for w in weights.values()]
            qkv = pack(torch.cat([weights["q"], weights["k"], weights["v"]]), rows, bf16)
            gate_up = pack(torch.cat([weights["gate"], weights["up"]]), rows, bf16)
            separate = ms_per_call(lambda: [product(x, p, bf16) for p in apart], args.calls)
            fused = ms_per_call(lambda: (product(x, qkv, bf16), product(x, gate_up, bf16)), args.calls)
            name = "bf16" if bf16 else "fp32"
            print(f"| {rows} | {name} | {separate:.3f} | {fused:.3f} | {fused / separate:.2f} |")


if __name__ == "__main__":
    main()
