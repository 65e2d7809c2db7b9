"""Decode speed of the HF engine against the roofline: how far one decode step is from the bound.

    .venv/bin/python bench/decode.py [--model smollm2-135m-instruct] [--rows 1,8,64] [--tokens 64]
                                     [--dtype float32|bfloat16] [--precision fp32|bf16] [--device cpu|cuda]
                                     [--graphs on|off|both] [--packed-weights on|off]
                                     [--fused-norms on|off] [--profile]

For each batch size the engine samples `rows` completions of exactly --tokens tokens (EOS is
ignored for the measurement, so every row decodes every step) and each step's time is taken
between two forward passes (the engine's per-token hook), sampling included. The bound of a
step is max(bytes read / bandwidth, FLOPs / peak): every multiplied weight plus the KV cache
at the step's context, over the measured read bandwidth on CPU or the datasheet's on GPU
(plait/telemetry/bandwidth.py); FLOPs over the measured matmul peak on CPU or the datasheet's.
On a GPU the engine decodes eagerly and through CUDA graphs (rollout/graphs.py), both printed
by default; the first call of each row count captures its graph (timed, left out of the steps),
and the captured step's replay alone is timed with CUDA events (the rest of a step is sampling
and Python). --profile then lists the kernels of one eager decoding step on a GPU (or the
operators on a CPU) by count: what a captured step replays.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from plait.models import load_tokenizer, resolve_model_path
from plait.rollout.hf import HFEngine
from plait.telemetry.bandwidth import decode_cost, device_bandwidth
from plait.telemetry.flops import device_peak
from plait.types import Prompt, SamplingParams


def step_times(engine: HFEngine, prompts: list[Prompt], params: SamplingParams, n: int) -> list[float]:
    """Seconds between consecutive forward passes of one generate call (decode steps only)."""
    stamps: list[float] = []

    def on_token() -> int:
        stamps.append(time.perf_counter())
        return 0

    engine.on_token = on_token
    try:
        engine.generate(prompts, params, n)
    finally:
        engine.on_token = None
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # stamps[0] precedes the prefill


def replay_ms(engine: HFEngine, n: int = 50) -> float:
    """GPU time of one replay of the newest bucket's captured step alone (no sampling, no Python
    between steps): how much of a step the forward itself takes."""
    bucket = next(reversed(engine.static.buckets.values()))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        bucket.graph.replay()  # rewrites one column: the bucket is reloaded by the next call
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def profile_step(engine: HFEngine, prompts: list[Prompt], params: SamplingParams, rows: int, top: int = 15) -> None:
    """Kernels (GPU) or operators (CPU) of one eager decoding step, by count and time."""
    from torch.profiler import ProfilerActivity, profile

    engine.cuda_graphs, engine.static = False, None
    short = SamplingParams(max_tokens=2, temperature=1.0, seed=1)
    engine.generate(prompts, short, rows)  # warm-up
    steps = 8
    cuda = next(engine.model.parameters()).is_cuda
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=1.0, seed=1), rows)  # prefill only
    prefill = prof.events()
    with profile(activities=activities) as prof:
        engine.generate(prompts, SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=1), rows)
    kind = "kernels" if cuda else "operators"

    def counted(events):
        out: dict[str, list[float]] = {}
        for e in events:
            if (e.device_type.name == "CUDA") == cuda and (cuda or e.cpu_parent is None):
                out.setdefault(e.name, []).append(e.device_time if cuda else e.cpu_time)
        return out

    every, first = counted(prof.events()), counted(prefill)
    per_step = {k: (len(v) - len(first.get(k, [])), sum(v) - sum(first.get(k, []))) for k, v in every.items()}
    total = sum(c for c, _ in per_step.values()) / steps
    print(f"\none eager decoding step at {rows} rows: {total:.0f} {kind} (mean of {steps} steps); the most frequent:")
    print(f"| {kind[:-1]} | per step | us per step |\n|---|---|---|")
    for name, (count, us) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name[:90]} | {count / steps:.0f} | {us / steps:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,8,64", help="batch sizes (rows decoding together), comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16"],
        help="the engine's rollout precision: bf16 on float32 weights is what train.precision=bf16 samples with "
        "(autocast on a GPU, packed bf16 copies on a CPU)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--graphs", choices=["on", "off", "both"], default="both", help="on a GPU: CUDA-graph decoding")
    ap.add_argument(
        "--packed-weights",
        choices=["on", "off"],
        default="on",
        help="rollout.packed_weights: packed copies on a CPU, bf16 copies for bf16 on a GPU (off: autocast's casts)",
    )
    ap.add_argument(
        "--fused-norms", choices=["on", "off"], default="on", help="torch's fused RMSNorm (rollout/fused.py)"
    )
    ap.add_argument("--profile", action="store_true", help="also list the kernels of one eager step at the most rows")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs] if device.type == "cuda" else [False]
    cost = decode_cost(model)
    bandwidth, bw_source = device_bandwidth(device)
    peak, peak_source = device_peak(device, "bf16" if dtype == torch.bfloat16 or args.precision == "bf16" else "fp32")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{args.model} {args.dtype} weights, {args.precision} rollouts, packed weights {args.packed_weights}, "
        f"fused norms {args.fused_norms}, {where}: "
        f"{cost.weight_bytes / 1e6:.0f} MB of weights read per step"
    )
    print(
        f"bandwidth {bandwidth / 1e9:.1f} GB/s ({bw_source}); peak {(peak or 0) / 1e12:.2f} TFLOP/s ({peak_source})\n"
    )
    print("| decoding | rows | ms per step | tokens/s | bound ms (kind) | x off the bound |\n|---|---|---|---|---|---|")
    batches = [int(r) for r in args.rows.split(",")]
    for graphed in modes:
        engine = HFEngine(
            model,
            tok,
            batch_size=max(batches),
            precision=args.precision,
            cuda_graphs=graphed,
            packed_weights=args.packed_weights == "on",
            fused_norms=args.fused_norms == "on",
        )
        engine.eos_ids = []  # every row decodes every step
        name = "CUDA graphs" if graphed else "eager"
        for rows in batches:
            step_times(engine, [Prompt(0, "", prompt)], params, rows)  # warm-up (and the graph's capture)
            captured = engine.stats().get("rollout/graph_capture_s")
            times = []
            for _ in range(args.reps):
                times += step_times(engine, [Prompt(0, "", prompt)], params, rows)
            ms = statistics.median(times)
            context = len(prompt) + args.tokens // 2  # the middle step's context
            bound, kind = cost.bound(rows, context, bandwidth, peak)
            row = f"| {name} | {rows} | {ms * 1e3:.2f} | {rows / ms:.0f} | {bound * 1e3:.3f} ({kind})"
            row += f" | {ms / bound:.2f}x |"
            if graphed:
                row += f" capture {captured:.2f} s, replay alone {replay_ms(engine):.2f} ms"
            print(row)
    if args.profile:
        profile_step(engine, [Prompt(0, "", prompt)], params, max(batches))


if __name__ == "__main__":
    main()
