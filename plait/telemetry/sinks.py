"""Where metrics go: the console (a progress bar and a compact line per round), one JSON
object per line in the run directory, TensorBoard event files, and Weights & Biases when
configured. Only the main process writes."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


# the compact per-round console line: (metric key, label, format)
CONSOLE_COLUMNS = [
    ("reward/total/mean", "reward", "{:.3f}"),
    ("accuracy", "acc", "{:.2f}"),
    ("completion/length_mean", "len", "{:.1f}"),
    ("completion/truncated", "trunc", "{:.2f}"),
    ("tools/calls_per_completion", "tools", "{:.2f}"),
    ("loss", "loss", "{:+.4f}"),
    ("kl", "kl", "{:.4f}"),
    ("teacher/kl", "tkl", "{:.4f}"),
    ("teacher/top_k_kl", "topkl", "{:.4f}"),
    ("clip/fraction", "clip", "{:.3f}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("time/generate", "gen", "{:.1f}s"),
    ("time/score", "score", "{:.2f}s"),
    ("time/train", "train", "{:.1f}s"),
    ("mfu/train", "mfu", "{:.0%}"),
]


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def _sample_rows(records: list[dict]) -> tuple[list[str], list[list]]:
    names = sorted({k for r in records for k in r["rewards"]})
    return ["prompt", "completion", "answer", *names], [
        [r["prompt"], r["completion"], str(r.get("answer")), *(r["rewards"].get(n) for n in names)] for r in records
    ]


class TensorBoardWriter:
    """Scalars under their metric names; sample completions as a markdown table (TEXT tab)."""

    def __init__(self, run_dir: Path, start: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # a restarted run hides the events of the rounds it runs again (TensorBoard's purge_step):
        # those after its checkpoint, or all of them (the evaluation at step 0 too) from scratch
        restarted = (run_dir / "tensorboard").is_dir()
        purge = (start + 1 if start else 0) if restarted else None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=30, purge_step=purge)

    def log(self, step: int, metrics: dict) -> None:
        # one event holding every scalar of the step: far cheaper than an add_scalar per metric
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in _numbers(metrics).items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)

    def samples(self, step: int, records: list[dict]) -> None:
        head, rows = _sample_rows(records)

        def cell(v) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        table += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(table), step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A W&B run, offline by default (RUN_DIR/wandb, `wandb sync` later); a resumed plait run
    continues the same W&B run (its id is kept in RUN_DIR/wandb_id). W&B keeps the first value
    logged at a step, so the rounds a resumed run repeats keep the values logged before the
    kill (the same numbers: resume is exact)."""

    def __init__(self, run_dir: Path, settings, config: dict):
        import wandb

        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or run_dir.name,
            tags=settings.tags,
            mode=settings.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(_numbers(metrics), step=step)

    def samples(self, step: int, records: list[dict]) -> None:
        head, rows = _sample_rows(records)
        self.run.log({"samples": self.wandb.Table(columns=head, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsSink:
    """Writes metrics.jsonl (+ TensorBoard / W&B) and shows a progress bar with ETA plus a
    compact line per round. A metrics.jsonl record names its round as `round`, and as `step` too:
    the name it had before, kept for one release so that tooling reading it goes on working."""

    def __init__(
        self, run_dir: Path | None, total_rounds: int, style: str = "rich", every: int = 1, start_round: int = 0
    ):
        self.path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
        self.writers: list = []
        self.every = every
        self.style = style
        self.console = Console(highlight=False, quiet=style == "none", soft_wrap=True)
        self.progress = None
        if style == "rich":
            self.progress = Progress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rounds"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("train", total=total_rounds, completed=start_round)
            self.progress.start()

    def open(self, run_dir: Path, log_cfg, config: dict, start: int = 0) -> None:
        """Start writing to the run directory: metrics.jsonl, and TensorBoard / W&B as configured;
        `start`: the round the run (re)starts after."""
        self.path = Path(run_dir) / "metrics.jsonl"
        if log_cfg.tensorboard:
            self.writers.append(TensorBoardWriter(Path(run_dir), start))
        if log_cfg.wandb is not None:
            self.writers.append(WandbWriter(Path(run_dir), log_cfg.wandb, config))

    def print(self, *msg: str) -> None:
        self.console.print(*msg)

    def log(self, round_: int, metrics: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                record = {"round": round_, "step": round_, **{k: _clean(v) for k, v in metrics.items()}}
                f.write(json.dumps(record) + "\n")
        for w in self.writers:
            w.log(round_, metrics)
        if self.progress is not None:
            self.progress.update(self.task, completed=round_)
        if round_ % self.every == 0:
            parts = [f"round {round_:>4}"]
            for key, label, fmt in CONSOLE_COLUMNS:
                if key in metrics and metrics[key] is not None:
                    parts.append(f"{label} {fmt.format(metrics[key])}")
            self.console.print("  ".join(parts))

    def samples(self, round_: int, records: list[dict]) -> None:
        """Sample completions: samples.jsonl, the console (the first), TensorBoard, W&B."""
        if self.path is None or not records:
            return
        with (self.path.parent / "samples.jsonl").open("a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        for w in self.writers:
            w.samples(round_, records)
        r = records[0]
        self.console.print(f"[dim]sample @ round {round_}: {r['completion'][:160]!r} rewards={r['rewards']}")

    def close(self) -> None:
        """Stop the progress bar (the run goes on to evaluate / summarize)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self) -> None:
        """Close the files and runs behind the sinks."""
        self.close()
        for w in self.writers:
            w.close()
        self.writers = []
