"""Where metrics go: one JSON object per line in the run directory, and the console."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# the compact per-step console line: (metric key, label, format)
CONSOLE_COLUMNS = [
    ("reward/total/mean", "reward", "{:.3f}"),
    ("accuracy", "acc", "{:.2f}"),
    ("completion/length_mean", "len", "{:.1f}"),
    ("completion/truncated", "trunc", "{:.2f}"),
    ("loss", "loss", "{:+.4f}"),
    ("kl", "kl", "{:.4f}"),
    ("clip/fraction", "clip", "{:.3f}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("time/generate", "gen", "{:.1f}s"),
    ("time/score", "score", "{:.2f}s"),
    ("time/train", "train", "{:.1f}s"),
]


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsSink:
    """Writes metrics.jsonl and shows a progress bar with ETA plus a compact line per step."""

    def __init__(self, run_dir: Path | None, total_steps: int, style: str = "rich", every: int = 1, start_step: int = 0):
        self.path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
        self.every = every
        self.style = style
        self.console = Console(highlight=False, quiet=style == "none", soft_wrap=True)
        self.progress = None
        if style == "rich":
            self.progress = Progress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
            self.progress.start()

    def print(self, *msg: str) -> None:
        self.console.print(*msg)

    def log(self, step: int, metrics: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **{k: _clean(v) for k, v in metrics.items()}}) + "\n")
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
        if step % self.every == 0:
            parts = [f"step {step:>4}"]
            for key, label, fmt in CONSOLE_COLUMNS:
                if key in metrics and metrics[key] is not None:
                    parts.append(f"{label} {fmt.format(metrics[key])}")
            self.console.print("  ".join(parts))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
