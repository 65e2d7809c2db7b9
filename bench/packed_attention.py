"""The training pass's attention over a packed row, two ways: one sdpa call under the row's
whole mask (what transformers' sdpa path does with plait's packed rows: the CPU flash kernel
computes every score of the S x S square, allowed or not; also through the math kernel), and
query tiles that each attend only to the keys some query of the tile may see (fewer scores, more
calls). Forward, and forward +
backward, per layer, in fp32 and bf16, at the shapes of SmolLM2-135M (9 heads of 64).

    .venv/bin/python bench/packed_attention.py [--reps 20] [--shared 200] [--completions 8]

The row is laid out by plait's own `pack_groups`, as the demo's micro-batches are: two groups
whose prompts share a long beginning (the worked examples), each with its own rest of the prompt
and its completions of 8-16 tokens. Prints the share of the square the mask allows, the largest
difference between the two ways' outputs, and the milliseconds of each. Say which CPU ran it
(`lscpu`).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from plait.algo.logprobs import pack_groups


HEADS, HEAD_DIM, HIDDEN = 9, 64, 576  # SmolLM2-135M


def demo_like_row(shared: int, rest: int, groups: int, completions: int, longest: int = 16) -> torch.Tensor:
    """The allowed mask [S, S] of one packed row of `groups` groups of `completions` each."""
    rng = random.Random(0)
    prompt_len = shared + rest
    ids, mask = [], []
    for g in range(groups):
        prompt = list(range(1, shared + 1)) + [1000 + 50 * g + i for i in range(rest)]
        for _ in range(completions):
            n = rng.randint(8, longest)
            ids.append(prompt + [2000 + rng.randint(0, 500) for _ in range(n)] + [0] * (longest - n))
            mask.append([1] * (prompt_len + n) + [0] * (longest - n))
    packed = pack_groups(torch.tensor(ids), torch.tensor(mask), prompt_len, [completions] * groups, HIDDEN)
    assert packed.allowed.shape[0] == 1, "the layout put the groups in rows of their own"
    return packed.allowed[0, 0]


def bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def whole(q, k, v, allowed, kernel: SDPBackend = SDPBackend.FLASH_ATTENTION):
    with sdpa_kernel(kernel):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias(allowed, q.dtype)[None, None])


def tiled(q, k, v, allowed, tile: int):
    out = []
    for start in range(0, allowed.shape[0], tile):
        sub = allowed[start : start + tile]
        keys = sub.any(0).nonzero().squeeze(1)
        m = bias(sub[:, keys], q.dtype)[None, None]
        out.append(
            F.scaled_dot_product_attention(q[:, :, start : start + tile], k[:, :, keys], v[:, :, keys], attn_mask=m)
        )
    return torch.cat(out, 2)


def timed(fn, reps: int, grad: torch.Tensor | None) -> float:
    for _ in range(3):
        out = fn()
        if grad is not None:
            out.backward(grad)
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
        if grad is not None:
            out.backward(grad)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shared", type=int, default=200, help="tokens of the prompts' shared beginning")
    ap.add_argument("--rest", type=int, default=20, help="tokens of each group's own rest of the prompt")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--completions", type=int, default=8)
    args = ap.parse_args()
    allowed = demo_like_row(args.shared, args.rest, args.groups, args.completions)
    width = allowed.shape[0]
    print(f"one packed row of {width} tokens; the mask allows {allowed.float().mean().item():.2f} of the square")
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, HEADS, width, HEAD_DIM, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, HEADS, width, HEAD_DIM, dtype=dtype)
        ref = whole(q, k, v, allowed)
        ways = {
            "whole mask": lambda: whole(q, k, v, allowed),
            "whole, math": lambda: whole(q, k, v, allowed, SDPBackend.MATH),
        }
        ways.update({f"tiles of {t}": (lambda t=t: tiled(q, k, v, allowed, t)) for t in (32, 64, 128)})
        for name, fn in ways.items():
            gap = (fn() - ref).abs().max().item()
            fwd, both = timed(fn, args.reps, None), timed(fn, args.reps, grad)
            print(
                f"{str(dtype):15} {name:11} forward {fwd:6.2f} ms  forward+backward {both:6.2f} ms  max gap {gap:.1e}"
            )


if __name__ == "__main__":
    main()
