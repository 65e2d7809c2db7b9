"""Asynchronous generation, measured against plait's default synchronous run on the same cores.

    .venv/bin/python bench/async.py [--ks sync,0,1,2] [--seeds 2] [--steps 10] [--prompts 2] [--work DIR]
                                    [--json out.json]

Each run trains the bundled SmolLM2-135M-Instruct on the arithmetic demo task. `sync` is what
a user gets without asking: the HF engine in the trainer's process, every core used by both
generation and training in turn. A number k runs generation in the HF engine's generation
process (one core) and the trainer on the other core, so the two can overlap (k >= 1) or take
turns (k = 0: each phase on one core, so slower than `sync`). Runs alternate between the
settings, once per seed.

It prints, for each setting: rounds per hour (from the rounds' wall time, start-up excluded),
the mean reward per round, where a round's time goes (the trainer's phases, and the generation
process's generate / push / idle seconds), and against `sync` (the baseline): the speed ratio
and sign-flip permutation tests of the reward curves, paired by seed: by round (round t of a
k-run samples from the weights of round t-1-k, so that curve lags k rounds by construction) and
by the weight version that generated the samples (what staleness costs the learning itself). A
large p means indistinguishable at this number of rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from _runs import train_metrics

from plait.types import round_of


BASELINE = "sync"


def run_once(k: str, seed: int, steps: int, prompts: int, work: Path) -> list[dict]:
    out = work / f"{'' if k == BASELINE else 'k'}{k}-seed{seed}"
    done = out / "metrics.jsonl"
    if done.is_file() and len(done.read_text().splitlines()) == steps:  # --work: a finished run is reused
        return [json.loads(line) for line in done.read_text().splitlines()]
    split = [
        f"rollout.max_staleness={k}",
        "rollout.generation_process=true",
        "train.threads=1",
        "rollout.generator_threads=1",
    ]
    sets = [
        *([] if k == BASELINE else split),
        f"rollout.prompts_per_step={prompts}",
        f"train.max_steps={steps}",
        f"seed={seed}",
        "eval.before=false",
        "eval.after=false",
        "checkpoint.save_final_model=false",
        "log.console=none",
        f"output_dir={out}",
    ]
    return train_metrics(sets, out, f"bench/async.py: k={k} seed={seed}")


def sign_flip_p(diffs: list[float], trials: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of mean(diffs) == 0 under random sign flips (exact when few)."""
    observed = abs(sum(diffs) / len(diffs))
    rng = random.Random(seed)
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs) / len(diffs)) >= observed for _ in range(trials))
    return (hits + 1) / (trials + 1)


def by_version(rounds: list[dict]) -> dict[int, float]:
    """Mean reward of the samples each weight version generated."""
    out: dict[int, list[float]] = {}
    for m in rounds:
        out.setdefault(int(m.get("async/scheduled_version", round_of(m) - 1)), []).append(m["reward/total/mean"])
    return {v: sum(x) / len(x) for v, x in out.items()}


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    out = {}
    base = runs.get(BASELINE)
    for k, per_seed in runs.items():
        rounds = [m for ms in per_seed for m in ms[1:]]  # round 1 waits for start-up: left out of the rates
        seconds = sum(m["time/step"] for m in rounds)
        phases: dict[str, float] = {}
        for m in rounds:
            for key, v in m.items():
                if key.startswith("time/") and key != "time/step":
                    phases[key[5:]] = phases.get(key[5:], 0.0) + v
        generator: dict[str, float] = {}
        for m in rounds:
            for key, v in m.items():
                if key.startswith("async/seconds_"):
                    generator[key[14:]] = generator.get(key[14:], 0.0) + v
        curve = [sum(ms[i]["reward/total/mean"] for ms in per_seed) / len(per_seed) for i in range(len(per_seed[0]))]
        row = {
            "rounds_per_hour": 3600 * len(rounds) / seconds,
            "seconds_per_round": seconds / len(rounds),
            "reward_per_round": [round(r, 4) for r in curve],
            "reward_mean": sum(curve) / len(curve),
            "trainer_share": {p: round(v / seconds, 3) for p, v in sorted(phases.items(), key=lambda kv: -kv[1])},
            "generator_seconds_per_round": {p: round(v / len(rounds), 2) for p, v in generator.items()},
            "staleness_mean": sum(m.get("rollout/staleness_mean", 0.0) for m in rounds) / len(rounds),
        }
        if base is not None and k != BASELINE:
            # by round: round t of a k-run measures the policy of version t-1-k, so it lags by k
            # rounds by construction; by version: samples of the same weight version compared
            # (what staleness costs the learning itself)
            diffs = [
                a["reward/total/mean"] - b["reward/total/mean"]
                for ka, kb in zip(per_seed, base)
                for a, b in zip(ka, kb)
            ]
            row["reward_vs_sync_p"] = sign_flip_p(diffs)
            pairs = [(by_version(ka), by_version(kb)) for ka, kb in zip(per_seed, base)]
            diffs = [a[v] - b[v] for a, b in pairs for v in a if v in b]
            row["reward_by_version_vs_sync"] = sum(diffs) / len(diffs)
            row["reward_by_version_vs_sync_p"] = sign_flip_p(diffs)
            base_seconds = sum(m["time/step"] for x in base for m in x[1:])
            row["speedup_vs_sync"] = row["rounds_per_hour"] / (3600 * sum(len(x) - 1 for x in base) / base_seconds)
        out[k] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="sync,0,1,2", help="sync (the default run), max_staleness values")
    ap.add_argument("--seeds", type=int, default=2, help="runs per k (seeds 0..N-1)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=2, help="rollout.prompts_per_step (8 completions each)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--work", help="folder for the runs (a run already finished there is reused, not rerun)")
    args = ap.parse_args(argv)
    ks = [k.strip() for k in args.ks.split(",")]
    bad = [k for k in ks if k != BASELINE and not k.isdigit()]
    if bad:
        ap.error(f"--ks: {bad} is neither sync nor a max_staleness (0, 1, 2, ...)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="plait-async-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {k: [] for k in ks}
    t0 = time.monotonic()
    for seed in range(args.seeds):
        order = ks[seed % len(ks) :] + ks[: seed % len(ks)]  # alternate which k goes first
        for k in order:
            runs[k].append(run_once(k, seed, args.steps, args.prompts, work))
            print(f"{k} seed={seed} done ({time.monotonic() - t0:.0f}s)", flush=True)
    summary = summarize(runs)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} cores; {args.steps} rounds x {args.seeds} seed(s) per k")
    for k, row in summary.items():
        extra = ""
        if "speedup_vs_sync" in row:
            extra = (
                f"\n      {row['speedup_vs_sync']:.2f}x the default sync run's rounds/hour; reward vs sync: by round "
                f"p={row['reward_vs_sync_p']:.2f} (lags k rounds by construction), by weight version "
                f"{row['reward_by_version_vs_sync']:+.3f} p={row['reward_by_version_vs_sync_p']:.2f}"
            )
        print(
            f"{k}: {row['rounds_per_hour']:.0f} rounds/h ({row['seconds_per_round']:.1f} s/round), "
            f"mean reward {row['reward_mean']:.3f}, staleness {row['staleness_mean']:.2f}{extra}"
        )
        print(f"      trainer time: {row['trainer_share']}")
        print(f"      generation process, s/round: {row['generator_seconds_per_round']}")
        print(f"      reward per round: {row['reward_per_round']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
