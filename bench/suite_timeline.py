"""Where the suite's time goes: a pytest plugin that writes each test's start, end, worker and the
machine's idle share while it ran (from /proc/stat), and a summary of what it wrote.

    PLAIT_TIMELINE=/tmp/tl PYTHONPATH=bench .venv/bin/python -m pytest -q -p no:cacheprovider \\
        -p suite_timeline -n 2 --dist loadgroup --no-loadscope-reorder
    .venv/bin/python bench/suite_timeline.py /tmp/tl

With `PYTHONPATH=bench:bench/proclog PLAIT_PROCLOG=/tmp/tl/procs.jsonl` as well, every Python process
the tests start that exits normally logs its start, end and CPU time (bench/proclog), and the summary
adds them up by kind (`plait train`, torchrun, processes started by spawn...).

The summary: the wall time from the first start to the last end, the test time by file, the
longest tests, the time each worker sat between tests, and the machine's idle share weighted by
each test's length (docs/testing.md, "Where the 30 minutes go"). Say which CPU ran it (`lscpu`).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest


def _cpu() -> tuple[int, int]:
    """All and idle (idle + iowait) jiffies of the machine so far."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each test's setup, call and teardown, in the process that runs it (an xdist worker,
    not the controller that only relays its reports)."""
    folder = os.environ.get("PLAIT_TIMELINE")
    start, (all0, idle0) = time.time(), _cpu()
    try:
        return (yield)
    finally:
        if folder:
            all1, idle1 = _cpu()
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            row = {"id": item.nodeid, "w": worker, "start": start, "end": time.time()}
            row["idle"] = (idle1 - idle0) / max(1, all1 - all0)
            with open(Path(folder) / f"times.{worker}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


def summary(folder: Path, longest: int = 20) -> None:
    rows = [json.loads(line) for f in sorted(folder.glob("times.*.jsonl")) for line in f.read_text().splitlines()]
    if not rows:
        raise SystemExit(f"no times.*.jsonl in {folder}: run the suite with PLAIT_TIMELINE={folder} first")
    seconds = [r["end"] - r["start"] for r in rows]
    total = sum(seconds)
    wall = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    idle = sum(s * r["idle"] for s, r in zip(seconds, rows)) / total
    print(f"{len(rows)} tests, {wall / 60:.1f} min from first start to last end, {total / 60:.1f} min of test time")
    print(f"machine idle {idle:.1%} (weighted by test length)")
    by_file = collections.Counter()
    for s, r in zip(seconds, rows):
        by_file[r["id"].split("::")[0]] += s
    for name, s in by_file.most_common(10):
        print(f"{s:7.0f} s  {name}")
    for s, r in sorted(zip(seconds, rows), key=lambda x: -x[0])[:longest]:
        print(f"{s:7.0f} s  {r['w']}  idle {r['idle']:.2f}  {r['id']}")
    for worker in sorted({r["w"] for r in rows}):
        mine = sorted((r for r in rows if r["w"] == worker), key=lambda r: r["start"])
        gaps = sum(max(0.0, b["start"] - a["end"]) for a, b in zip(mine, mine[1:]))
        print(f"{worker}: {len(mine)} tests, {gaps:.0f} s between them")
    if (folder / "procs.jsonl").is_file():
        processes(folder / "procs.jsonl")


def _kind(argv: str) -> str:
    words = argv.split()
    if not words:
        return "?"
    name = Path(words[0]).name
    if name == "__main__.py" and Path(words[0]).parent.name == "plait" and len(words) > 1:
        return f"plait {words[1]}"
    return {"run.py": "torchrun", "-c": "started by spawn (-c)"}.get(name, name)


def processes(log: Path) -> None:
    """The logged processes by kind: how many, their seconds alive and their CPU seconds."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for r in rows:
        k = kinds[_kind(r["argv"])]
        k[0] += 1
        k[1] += r["end"] - r["start"]
        k[2] += r["user"]
        k[3] += r["sys"]
    print(
        f"{len(rows)} processes exited normally: {sum(r['user'] for r in rows):.0f} s user CPU, "
        f"{sum(r['sys'] for r in rows):.0f} s system"
    )
    for name, (n, alive, user, system) in sorted(kinds.items(), key=lambda x: -x[1][2] - x[1][3])[:12]:
        print(f"{n:5d} x {name:28s} alive {alive:6.0f} s  user {user:6.0f} s  system {system:5.0f} s")


if __name__ == "__main__":
    summary(Path(sys.argv[1]))
