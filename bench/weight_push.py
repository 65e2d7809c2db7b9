"""How long one weight push to the HF generation process takes: through the shared-memory file
(`rollout.shared_memory_weights: true`, the default on CPU) and through the gloo broadcast.

    .venv/bin/python bench/weight_push.py [--model smollm2-135m-instruct] [--reps 5]

Starts the generation process as an async run does (`make_generator`), pushes the model's full
weights `--reps` times each way and prints the seconds per push (the first one apart: it maps
the file or forms the weight group) and the bytes. The process is then asked to generate, and
its log-probs are compared with the same request answered after a broadcast push: equal means
both ways delivered the same bits. Say which CPU ran it (`lscpu`).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from plait.config import load_config
from plait.models import load_model, load_tokenizer
from plait.rollout import make_generator
from plait.rollout.weights import full_weights
from plait.types import Prompt, SamplingParams


def pushes(model_name: str, shared: bool, reps: int) -> tuple[list[float], float, list]:
    """(seconds of each push, gigabytes per push, log-probs of a greedy generation after them)."""
    cfg = load_config(None, [f"model.name_or_path={model_name}", f"rollout.shared_memory_weights={shared}"])
    tokenizer = load_tokenizer(model_name)
    model = load_model(model_name, "float32")
    with torch.no_grad():  # other weights than the engine loaded, so a push that delivers nothing shows
        for p in model.parameters():
            p.mul_(1.01)
    engine, close = make_generator(cfg, tokenizer, torch.device("cpu"))
    seconds, gb = [], 0.0
    try:
        with full_weights(model) as weights:
            for version in range(1, reps + 1):
                engine.push_weights(weights, version)
                stats = engine.stats()
                assert stats["weight_sync/shared_memory"] == float(shared)
                seconds.append(stats["weight_sync/seconds"])
                gb = stats["weight_sync/gb"]
        ids = tokenizer("What is 12 + 30?")["input_ids"]
        out = engine.generate([Prompt(0, "", ids)], SamplingParams(max_tokens=16, temperature=0.0), 1)
        return seconds, gb, out[0][0].logprobs
    finally:
        close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    results = {shared: pushes(args.model, shared, args.reps) for shared in (True, False)}
    print(f"{'transport':<16} {'GB':>6} {'first s':>8} {'then s (median)':>16} {'GB/s':>6}")
    for shared, (seconds, gb, _) in results.items():
        later = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
        name = "shared memory" if shared else "gloo broadcast"
        print(f"{name:<16} {gb:6.3f} {seconds[0]:8.3f} {later:16.3f} {gb / later:6.2f}")
    same = results[True][2] == results[False][2]
    print(f"greedy log-probs after the pushes: {'equal' if same else 'DIFFERENT'} both ways")


if __name__ == "__main__":
    main()
