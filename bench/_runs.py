"""What several benches share: one `plait train` process with `--set` overrides, its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def train_metrics(sets: list[str], out: Path, what: str) -> list[dict]:
    """Run `plait train --set S ...` (output_dir=`out` among `sets`) and return its metrics.jsonl
    rows; a failed run stops the bench with `what` and the run's stderr."""
    cmd = [sys.executable, "-m", "plait", "train", *sum((["--set", s] for s in sets), [])]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{what} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
