"""One demo generation call with the HF engine three ways: decoding attention through
transformers' sdpa path (which copies every shared key/value head out to its query heads whenever
a mask is given) with transformers' cache (each prompt's keys and values copied to its n rows,
grown by concatenation at every step); through plait's grouped attention
(plait/rollout/packed.py::grouped_attention_forward) with that cache; and grouped with plait's
shared-prefix cache (plait/rollout/prefix.py: one copy of each prompt per group, each row's own
tokens written in place), the engine's default on CPU.

    .venv/bin/python bench/decode_attention.py [--reps 4] [--prompts 8] [--generations 8] [--tokens 32]

The prompts are the built-in demo's (its worked examples included), sampled at temperature 1
with the demo's seed handling; the ways run alternately in one process under plait's retained
host memory, as in a run. Prints the seconds of each call, the speed-up over the first way, how
many completions each sampled exactly as the first way did (float rounding differs between the
ways, and a sample near a boundary of the inverse CDF can flip), and the largest log-prob
difference of the tokens both sampled alike. Say which CPU ran it (`lscpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import plait.rollout.hf as hf
import plait.rollout.prefix as prefix
from plait.config import load_config
from plait.data import build_prompts, load_rows
from plait.models import load_model, load_tokenizer
from plait.train.hostmem import retained_host_memory
from plait.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()

    cfg = load_config(None, [])
    tok = load_tokenizer(cfg.model.name_or_path)
    prompts = build_prompts(load_rows(cfg.data, "train", 0)[: args.prompts], tok, cfg.data, log=lambda *a: None)
    model = load_model(cfg.model.name_or_path)
    engine = hf.HFEngine(model, tok, batch_size=args.prompts * args.generations)
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1)
    grouped, shared, copied = hf.grouped_attention, prefix.share_prefix, lambda *a: False
    ways = {
        "sdpa (repeat_kv)": (lambda m: contextlib.nullcontext(), copied),
        "grouped": (grouped, copied),
        "grouped, shared prefix": (grouped, shared),
    }
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    sampled = {}
    with retained_host_memory(True):
        engine.generate(prompts, params, n=args.generations)  # warm-up
        for _ in range(args.reps):
            for way, (attention, cache) in ways.items():
                hf.grouped_attention, prefix.share_prefix = attention, cache
                start = time.perf_counter()
                groups = engine.generate(prompts, params, n=args.generations)
                seconds[way].append(time.perf_counter() - start)
                sampled[way] = [c for g in groups for c in g]
    print(f"{len(prompts)} prompts of {len(prompts[0].token_ids)} tokens x {args.generations} x {args.tokens} tokens")
    base = statistics.median(seconds["sdpa (repeat_kv)"])
    first = sampled["sdpa (repeat_kv)"]
    for way, s in seconds.items():
        same = sum(x.token_ids == y.token_ids for x, y in zip(first, sampled[way]))
        gap = max(abs(p - q) for x, y in zip(first, sampled[way]) for p, q in agreeing(x, y))
        print(
            f"{way:24s} median {statistics.median(s):.2f} s ({', '.join(f'{x:.2f}' for x in s)}), "
            f"{base / statistics.median(s):.2f}x; {same} of {len(first)} completions as sdpa's, log-probs within "
            f"{gap:.2g} up to the first token that differs"
        )


def agreeing(x, y) -> list[tuple[float, float]]:
    """The two completions' log-probs up to and including their first different token (the
    same distribution sampled; after it, the two continue different texts)."""
    pairs = []
    for a, b, p, q in zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs):
        if a != b:
            break
        pairs.append((p, q))
    return pairs


if __name__ == "__main__":
    main()
