"""Sandbox overhead: seconds per execution (p50/p99) and executions per second, per tier.

    .venv/bin/python bench/sandbox.py [--n 100] [--workers 1 2 4]

Each execution runs a trivial program with one passing test, so the time is the sandbox's
own cost: supervisor start, namespaces and mounts (tiers >= namespaces), seccomp filter
build, the program's interpreter start-up, teardown and the kill sweep. Throughput runs
`workers` executions at once, as code rewards do.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from plait import sandbox


PROGRAM = "def f(x):\n    return x + 1\n"
TESTS = ["assert f(1) == 2"]


def one(tier: str) -> float:
    start = time.perf_counter()
    res = sandbox.run_tests(PROGRAM, TESTS, tier=tier)
    assert res.all_passed, res
    return time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    print(sandbox.describe())
    print("\n| tier | p50 s/exec | p99 s/exec | " + " | ".join(f"exec/s @{w}" for w in args.workers) + " |")
    print("|---|---|---|" + "---|" * len(args.workers))
    for tier, why in sandbox.probe().items():
        if why is not None:
            continue
        one(tier)  # warm the page cache
        lat = [one(tier) for _ in range(args.n)]
        rates = []
        for w in args.workers:
            start = time.perf_counter()
            with ThreadPoolExecutor(w) as pool:
                list(pool.map(lambda _: one(tier), range(args.n)))
            rates.append(args.n / (time.perf_counter() - start))
        print(
            f"| {tier} | {statistics.median(lat):.3f} | {pct(lat, 0.99):.3f} | "
            + " | ".join(f"{r:.1f}" for r in rates)
            + " |"
        )


if __name__ == "__main__":
    main()
