"""A LoRA run's weight push to a colocated vLLM engine: the adapter alone (vLLM's own LoRA,
`rollout.lora_push: adapter`, the default) against the merged weights (`merged`).

    .venv/bin/python bench/vllm_lora.py [--model smollm2-135m-instruct] [--r 16] [--reps 5]

Each way runs in a process of its own (one vLLM engine at a time): the engine is made as a run
makes it, the adapter is given new values `--reps` times (B drawn at random, so every push
changes what the engine must sample from) and pushed; each push's seconds and bytes are those
the run logs (`weight_sync/seconds`, `weight_sync/gb`). After each push one round is sampled
(8 prompts x 8 completions, up to 32 tokens, temperature 1) and timed, and the trainer's
log-probs of the sampled tokens are recomputed: the largest gap says the engine held the
trainer's weights. Say which CPU ran it (`lscpu`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def one_way(model_name: str, push: str, r: int, reps: int) -> dict:
    from peft import LoraConfig, get_peft_model

    from plait.algo.logprobs import selective_log_softmax
    from plait.config import load_config
    from plait.models import load_model, load_tokenizer
    from plait.rollout import make_engine
    from plait.types import Prompt, SamplingParams

    sets = [f"model.name_or_path={model_name}", "rollout.engine=vllm", f"rollout.lora_push={push}"]
    cfg = load_config(None, [*sets, f"model.lora={{r: {r}}}", "train.precision=fp32"])
    tokenizer = load_tokenizer(model_name)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear")
    model = get_peft_model(load_model(model_name, "float32"), lora)
    engine = make_engine(cfg, model, tokenizer)
    prompts = [Prompt(i, "", tokenizer(f"What is {i + 11} + {3 * i + 7}?")["input_ids"]) for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=0)
    pushes, rounds, gaps, gb = [], [], [], 0.0
    try:
        for version in range(1, reps + 1):
            torch.manual_seed(version)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02)
            with engine.weights_for_round(version):
                stats = engine.stats()
                pushes.append(stats["weight_sync/seconds"])
                gb = stats.get("weight_sync/gb", 0.0)
                t0 = time.perf_counter()
                groups = engine.generate(prompts, params, n=8)
                rounds.append(time.perf_counter() - t0)
            gaps.append(max_gap(model, groups, prompts, selective_log_softmax))
    finally:
        engine.close()
    return dict(push=push, pushes=pushes, gb=gb, rounds=rounds, gap=max(gaps))


def max_gap(model, groups, prompts, logprobs_of) -> float:
    """Largest |trainer log-prob - engine log-prob| over the sampled tokens."""
    worst = 0.0
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            for c in group:
                ids = torch.tensor([prompt.token_ids + c.token_ids])
                logits = model(ids).logits[:, len(prompt.token_ids) - 1 : -1]
                mine = logprobs_of(logits, torch.tensor([c.token_ids]))[0]
                worst = max(worst, (mine - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--one", choices=["adapter", "merged"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_way(args.model, args.one, args.r, args.reps)))
        return
    results = []
    for push in ("adapter", "merged"):
        cmd = [sys.executable, __file__, "--model", args.model, "--r", str(args.r), "--reps", str(args.reps)]
        out = subprocess.run([*cmd, "--one", push], capture_output=True, text=True, check=True).stdout
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    print(f"{args.model}, LoRA r={args.r} on every linear layer, colocated vLLM, fp32, {args.reps} pushes each way")
    print(f"{'push':<8} {'MB':>8} {'push s (median)':>16} {'round s (median)':>17} {'max log-prob gap':>17}")
    for r in results:
        print(
            f"{r['push']:<8} {r['gb'] * 1e3:>8.1f} {statistics.median(r['pushes']):>16.3f} "
            f"{statistics.median(r['rounds']):>17.2f} {r['gap']:>17.2e}"
        )


if __name__ == "__main__":
    main()
