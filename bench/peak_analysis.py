"""What comes before a fall: reads seed folders of `plait train --seeds` and prints, per run,
the held-out accuracy before and after, the sampled accuracy's peak and the mean of its last 3
rounds; then, over every round of every run, how the next round's sampled accuracy moved
after an update made from few informative completions and after one made from many.

    python bench/peak_analysis.py runs/demo-base runs/demo-signal ...

An update's informative share is `update/signal_share` (completions with a non-zero advantage),
or 1 - `groups/all_equal` in runs that did not log it. The sampled accuracy of one round is a
mean over 8 prompts (its standard error is about 0.17 at 0.5), so single rounds say little; the
means over many rounds are what the docs quote.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def informative(m: dict) -> float:
    return m["update/signal_share"] if "update/signal_share" in m else 1.0 - m["groups/all_equal"]


def run_row(run: Path) -> dict:
    metrics = records(run / "metrics.jsonl")
    evals = {e["tag"]: e for e in records(run / "eval.jsonl")} if (run / "eval.jsonl").is_file() else {}
    metric = next((k for e in evals.values() for k in e if k not in ("tag", "round", "step", "n")), None)
    held_out = [(e["round"], e[metric]) for e in records(run / "eval.jsonl") if metric in e] if metric else []
    acc = [m["accuracy"] for m in metrics]
    peak = max(range(len(acc)), key=acc.__getitem__)
    return {
        "run": run.name,
        "before": evals.get("before", {}).get(metric),
        "after": evals.get("after", {}).get(metric),
        "peak": acc[peak],
        "peak_round": peak + 1,
        "last3": statistics.fmean(acc[-3:]),
        "held_out": held_out,  # (round, greedy accuracy) at every evaluation
        "entropy": (metrics[0].get("entropy"), metrics[-1].get("entropy")),
        "informative": statistics.fmean(informative(m) for m in metrics),
        # the candidates ruled in or out: each one's largest (or mean) value over the run
        "clip": max(m.get("clip/fraction", 0.0) for m in metrics),
        "gap": max(m.get("logprob_gap", 0.0) for m in metrics),
        "truncated": max(m.get("completion/truncated", 0.0) for m in metrics),
        "length": (
            min(m["completion/length_mean"] for m in metrics),
            max(m["completion/length_mean"] for m in metrics),
        ),
        "clipped_norm": statistics.fmean(m.get("grad_norm", 0.0) > 1.0 for m in metrics),
    }


def moves(runs: list[Path], cut: float = 0.4) -> dict[str, list[float]]:
    """The next round's change in sampled accuracy after updates from a share of informative
    completions below `cut`, and at or above it."""
    out = {"few": [], "many": []}
    for run in runs:
        metrics = records(run / "metrics.jsonl")
        for now, nxt in zip(metrics, metrics[1:]):
            out["few" if informative(now) < cut else "many"].append(nxt["accuracy"] - now["accuracy"])
    return out


def flat_policy(accuracy: float, rounds: int, prompts: int = 8, runs: int = 5000, seed: int = 0) -> tuple[float, float]:
    """What the peak criterion gives a policy that never changes: each round draws `prompts`
    prompts, each answered right (every one of its completions) with probability `accuracy`, as
    a policy at entropy ~0.05 does. The median over `runs` simulated runs of the last 3 rounds'
    mean over the highest round, and the share of runs where it is >= 0.9. A calculation, not a
    measurement: it shows how far the highest of `rounds` noisy rounds lies above the policy."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(runs):
        acc = [sum(rng.random() < accuracy for _ in range(prompts)) / prompts for _ in range(rounds)]
        ratios.append(statistics.fmean(acc[-3:]) / max(max(acc), 1e-9))
    return statistics.median(ratios), sum(r >= 0.9 for r in ratios) / runs


def held_out_line(held_out: list[tuple[int, float]]) -> str:
    if len(held_out) < 3:
        return ""
    best = max(held_out, key=lambda e: e[1])
    curve = ", ".join(f"{v:.2f} ({r})" for r, v in held_out)
    ratio = held_out[-1][1] / max(best[1], 1e-9)
    head = "  greedy held-out at each evaluation (round)"
    return f"{head}: {curve}; best {best[1]:.2f} (round {best[0]}), final/best {ratio:.2f}"


def main(groups: list[str]) -> None:
    for group in map(Path, groups):
        runs = sorted(p for p in group.iterdir() if (p / "metrics.jsonl").is_file())
        print(f"== {group}")
        for r in map(run_row, runs):
            e0, e1 = r["entropy"]
            print(
                f"{r['run']}: greedy {r['before']} -> {r['after']}; sampled peak {r['peak']:.2f} (round "
                f"{r['peak_round']}), last 3 {r['last3']:.2f} ({r['last3'] / max(r['peak'], 1e-9):.2f} of the peak); "
                f"entropy {e0:.2f} -> {e1:.2f}; informative share {r['informative']:.2f}"
            )
            print(
                f"  largest clip fraction {r['clip']:.3f}, engine/trainer log-prob gap {r['gap']:.2g}, truncated "
                f"{r['truncated']:.2f}; mean length {r['length'][0]:.1f}-{r['length'][1]:.1f}; gradient norm above "
                f"1 (clipped at the default max_grad_norm) in {r['clipped_norm']:.0%} of the rounds"
            )
            if line := held_out_line(r["held_out"]):
                print(line)
        rows = [run_row(run) for run in runs]
        finals = [r["last3"] for r in rows]
        if finals:
            level = statistics.fmean(finals)
            median, share = flat_policy(level, len(records(runs[0] / "metrics.jsonl")))
            print(
                f"  a policy that never changed at this group's last-3 sampled accuracy ({level:.2f}) would show a "
                f"last-3/peak ratio of {median:.2f} (median of simulated runs), >= 0.9 in {share:.0%} of them"
            )
        for kind, values in moves(runs).items():
            if values:
                mean = statistics.fmean(values)
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                print(
                    f"  after updates from {kind} informative completions: next round's sampled accuracy "
                    f"{mean:+.3f} +- {sd:.3f} (n = {len(values)})"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
