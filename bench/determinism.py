"""What train.deterministic costs, and what it pins: the built-in demo, a few rounds, with and
without it, each run its own `plait train` process (the deterministic one restarts itself with
the kernels capped to AVX2 before torch loads).

    .venv/bin/python bench/determinism.py [--rounds 5] [--repeats 2] [--work DIR] [--json out.json]

Runs alternate between the two modes (`repeats` of each). It prints seconds per round (each
round's time/step, the first round left out: it holds the start-up) for each mode and their
ratio, whether the two deterministic runs agree bit for bit (metrics and per-round hashes, by
`plait diff`), and whether a plain run agrees with a deterministic one (it need not: on a CPU
with more than AVX2 the plain run's kernels sum in another order). Name the
CPU (`lscpu`) with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _runs import train_metrics


def run_once(deterministic: bool, rounds: int, out: Path) -> list[dict]:
    sets = [
        f"train.deterministic={str(deterministic).lower()}",
        f"train.max_steps={rounds}",
        "eval.before=false",
        "eval.after=false",
        "checkpoint.save_final_model=false",
        "log.console=none",
        f"output_dir={out}",
    ]
    return train_metrics(sets, out, f"bench/determinism.py: run {out}")


def seconds_per_round(rows: list[dict]) -> float:
    return statistics.mean(r["time/step"] for r in rows[1:])


def agree(a: Path, b: Path) -> bool:
    res = subprocess.run([sys.executable, "-m", "plait", "diff", str(a), str(b)], capture_output=True, text=True)
    return res.returncode == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", help="folder for the runs (default: a temporary one)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="plait-determinism-"))
    times: dict[str, list[float]] = {"plain": [], "deterministic": []}
    dirs: dict[str, list[Path]] = {"plain": [], "deterministic": []}
    for i in range(args.repeats):
        for mode in ("plain", "deterministic"):
            out = work / f"{mode}-{i}"
            rows = run_once(mode == "deterministic", args.rounds, out)
            times[mode].append(seconds_per_round(rows))
            dirs[mode].append(out)
            print(f"{mode} run {i}: {times[mode][-1]:.2f} s per round", flush=True)
    figures = {
        "seconds_per_round": {m: statistics.mean(t) for m, t in times.items()},
        "runs": times,
        "deterministic_runs_agree": agree(*dirs["deterministic"][:2]) if args.repeats > 1 else None,
        "plain_runs_agree": agree(*dirs["plain"][:2]) if args.repeats > 1 else None,
        "plain_agrees_with_deterministic": agree(dirs["plain"][0], dirs["deterministic"][0]),
    }
    figures["cost"] = figures["seconds_per_round"]["deterministic"] / figures["seconds_per_round"]["plain"]
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
