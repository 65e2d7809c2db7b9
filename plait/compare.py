"""Several runs as one measurement: `plait train --seeds 0,1,2` and `plait compare`.

A claim that a run learned, or that config A beats config B, is made over seeds: one run can
land on either side of a knife edge. `--seeds` runs the same config once per seed, one after
another, into RUN_DIR/seed-S; `plait compare` reads run directories (a run, or a folder of seed
runs, is one group) and writes, per group and round, the mean and spread of every metric: to
the console, to COMPARE_DIR/compare.json, to TensorBoard (COMPARE_DIR/tensorboard, one run per
group) and to COMPARE_DIR/index.html with the curves and their band.

Two groups' final values are compared with Welch's t-test (scipy.stats.ttest_ind with
equal_var=False): it assumes each group's per-seed final values are independent draws from a
normal distribution, with possibly different variances. With fewer than 2 runs in a group
there is no test. The p-value is printed as it is; with 3 seeds a group only a large difference
can reach significance, and the output says so.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from plait.types import round_of


# the metrics shown first (others follow in compare.json); the final metric by default
HEADLINE = (
    "reward/total/mean",
    "accuracy",
    "loss",
    "teacher/kl",
    "teacher/top_k_kl",
    "entropy",
    "grad_norm",
    "completion/length_mean",
)


class CompareError(ValueError):
    """Run directories plait compare cannot read."""


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' or '0-4' (or a mix: '0-2,7') -> the seeds, in order, without repeats."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            found = list(range(int(lo), int(hi) + 1)) if dash else [int(part)]
        except ValueError:
            raise ValueError(f"--seeds {text!r}: give seeds as 0,1,2 or 0-4") from None
        seeds += [s for s in found if s not in seeds]
    if not seeds:
        raise ValueError(f"--seeds {text!r}: no seed")
    return seeds


@dataclass
class Group:
    """Runs of one config (one per seed) under one label."""

    label: str
    runs: list[Path]
    histories: list[list[dict]] = field(default_factory=list)
    finals: list[dict] = field(default_factory=list)  # each run's eval.jsonl "after" record, if any
    evals: list[list[dict]] = field(default_factory=list)  # each run's eval.jsonl records, in order
    notes: list[list[str]] = field(default_factory=list)  # each run's learning notes (plait.telemetry.advice)


def read_group(path: Path) -> Group:
    """A run directory (a group of one), or a folder whose subfolders are runs (a seed group)."""
    path = Path(path)
    runs = [path] if (path / "metrics.jsonl").is_file() else sorted(p.parent for p in path.glob("*/metrics.jsonl"))
    if not runs:
        raise CompareError(f"{path}: no metrics.jsonl in it or in its subfolders (a run directory, or `--seeds` one)")
    group = Group(path.name, runs)
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        group.histories.append(rows)
        evals = run / "eval.jsonl"
        records = [json.loads(x) for x in evals.read_text().splitlines() if x.strip()] if evals.is_file() else []
        after = [e for e in records if e.get("tag") == "after"]
        group.finals.append(after[-1] if after else {})
        group.evals.append(records)
        group.notes.append(learning_notes(run, rows, records))
    return group


def learning_notes(run: Path, history: list[dict], evals: list[dict]) -> list[str]:
    """The notes a run printed at its end (read again from its files: its config.yaml, if this
    plait can load it, names the knobs)."""
    from plait.config import ConfigError, load_config
    from plait.telemetry.advice import health_notes

    try:
        cfg = load_config(str(run / "config.yaml")) if (run / "config.yaml").is_file() else None
    except (ConfigError, ValueError, OSError):  # another plait version's config
        cfg = None
    return health_notes(history, evals, cfg, cfg.eval.metric if cfg else None)


def per_round(group: Group) -> dict[str, dict[int, list[float]]]:
    """metric -> round -> the runs' values (runs that logged it)."""
    out: dict[str, dict[int, list[float]]] = {}
    for history in group.histories:
        for row in history:
            for key, value in row.items():
                if key not in ("round", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                    out.setdefault(key, {}).setdefault(round_of(row), []).append(float(value))
    return out


def run_curves(group: Group, key: str) -> list[list[tuple[int, float]]]:
    """Each run's (round, value) pairs of one metric."""
    return [[(round_of(row), float(row[key])) for row in history if key in row] for history in group.histories]


def band(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one run), min and max of the runs' values."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": sd, "min": min(values), "max": max(values), "n": len(values)}


def final_values(group: Group, metric: str) -> list[float]:
    """Each run's final value of `metric`: its evaluation after training when it has one (the
    eval metric's name), else the metric in the run's last round."""
    values = []
    for history, final in zip(group.histories, group.finals):
        if metric in final:
            values.append(float(final[metric]))
        else:
            last = [row[metric] for row in history if metric in row]
            if last:
                values.append(float(last[-1]))
    return values


def held_out(group: Group, metric: str) -> list[list[tuple[int, float]]]:
    """Each run's evaluations of `metric` by round (before, during and after training; not the
    evaluation of a state recovery restored, which an earlier one measured)."""
    return [
        [(round_of(e), float(e[metric])) for e in records if metric in e and "restored" not in e]
        for records in group.evals
    ]


def holding(curve: list[tuple[int, float]], final: float | None = None) -> dict[str, float]:
    """Whether a run held its best evaluation: the best, its round, what the run ended with
    (`final`: its last "after" evaluation, else the curve's last), and final / best."""
    best_round, best = max(curve, key=lambda e: e[1])
    final = curve[-1][1] if final is None else final
    return {"best": best, "best_round": best_round, "final": final, "final_over_best": final / best}


def welch(a: list[float], b: list[float]) -> dict[str, float] | None:
    """Welch's t-test of two groups' final values (None with fewer than 2 in a group, or no spread)."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy.stats import ttest_ind

    res = ttest_ind(a, b, equal_var=False)
    if not math.isfinite(res.pvalue):  # both groups constant
        return None
    return {"t": float(res.statistic), "p": float(res.pvalue), "df": float(res.df)}


def summarize(groups: list[Group], metric: str) -> dict:
    """Everything compare writes: per group, per metric, per round, the band; the final values
    and, for each pair of groups, the test."""
    out = {"metric": metric, "groups": {}, "tests": []}
    for g in groups:
        rounds = per_round(g)
        out["groups"][g.label] = {
            "runs": [str(r) for r in g.runs],
            "final": {"values": final_values(g, metric)},
            "notes": {r.name: n for r, n in zip(g.runs, g.notes) if n},
            "rounds": {k: {r: band(v) for r, v in sorted(by.items())} for k, by in sorted(rounds.items())},
            "curves": {k: run_curves(g, k) for k in HEADLINE},  # each run's own, for the figures
        }
        curves = held_out(g, metric)
        if any(len(c) > 2 for c in curves):  # evaluated during the run, not only before and after
            by: dict[int, list[float]] = {}
            for curve in curves:
                for r, v in curve:
                    by.setdefault(r, []).append(v)
            key = f"eval/{metric}"
            out["groups"][g.label]["rounds"][key] = {r: band(v) for r, v in sorted(by.items())}
            out["groups"][g.label]["curves"][key] = curves
            ends = [f.get(metric) for f in g.finals]
            held = [holding(c, e) for c, e in zip(curves, ends) if c and max(v for _, v in c) > 0]
            out["groups"][g.label]["held"] = held
        vals = out["groups"][g.label]["final"]["values"]
        if vals:
            out["groups"][g.label]["final"].update(band(vals))
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            test = welch(final_values(a, metric), final_values(b, metric))
            out["tests"].append({"a": a.label, "b": b.label, "welch": test})
    return out


def describe(summary: dict) -> str:
    """The console's view: each group's final metric with its spread, the headline metrics at
    the first and last round, and each test said plainly."""
    metric = summary["metric"]
    lines = [f"final {metric} (evaluation after training where there is one, else the last round):"]
    for label, g in summary["groups"].items():
        f = g["final"]
        if f.get("n"):
            lines.append(
                f"  {label}: {f['mean']:.4g} +- {f['std']:.2g} (sd over {f['n']} run(s); "
                f"min {f['min']:.4g}, max {f['max']:.4g}): {', '.join(f'{v:.4g}' for v in f['values'])}"
            )
        else:
            lines.append(f"  {label}: no run logged {metric}")
    for label, g in summary["groups"].items():
        lines.append(f"{label}, mean +- sd over runs (first round -> last round):")
        for key in HEADLINE:
            by = g["rounds"].get(key)
            if by:
                first, last = by[min(by)], by[max(by)]
                start = f"{first['mean']:.4g} +- {first['std']:.2g}"
                lines.append(f"  {key:<24} {start}  ->  {last['mean']:.4g} +- {last['std']:.2g}")
    for label, g in summary["groups"].items():
        by = by_round(g["rounds"].get(f"eval/{metric}"))
        if by and g.get("held"):
            curve = ", ".join(f"{b['mean']:.3g} ({r})" for r, b in sorted(by.items()))
            ratios = ", ".join(f"{h['final_over_best']:.2f}" for h in g["held"])
            lines.append(f"{label}, {metric} at each evaluation, mean over runs (round): {curve}")
            lines.append(f"  each run's last evaluation over its best: {ratios}")
    for label, g in summary["groups"].items():
        for run, notes in g.get("notes", {}).items():
            lines += [f"{label}/{run}, learning: {note}" for note in notes]
    for t in summary["tests"]:
        w = t["welch"]
        if w is None:
            lines.append(f"{t['a']} vs {t['b']}: no test (needs 2+ runs with some spread in each group)")
        else:
            verdict = "a difference this large would be rare" if w["p"] < 0.05 else "not distinguishable"
            lines.append(
                f"{t['a']} vs {t['b']} on final {metric}: Welch's t-test t = {w['t']:.3g}, df = {w['df']:.3g}, "
                f"p = {w['p']:.3g} ({verdict} if the groups had the same mean; assumes normal, independent "
                "per-run values)"
            )
    return "\n".join(lines)


def by_round(values: dict | None) -> dict[int, dict]:
    """A metric's per-round entries keyed by round number (compare.json, read back, has them as
    strings: drawn as they are, they would be categories in text order, 1, 10, 11, ..., 2)."""
    return {int(r): v for r, v in (values or {}).items()}


def figure(summary: dict, key: str) -> bytes | None:
    """One metric's curves: each group's mean per round and its min-max band over runs."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 3.2))
    drawn = False
    for label, g in summary["groups"].items():
        by = by_round(g["rounds"].get(key))
        if not by:
            continue
        rounds = sorted(by)
        mean = [by[r]["mean"] for r in rounds]
        (line,) = ax.plot(rounds, mean, label=f"{label} (n={max(by[r]['n'] for r in rounds)})", linewidth=2)
        ax.fill_between(
            rounds, [by[r]["min"] for r in rounds], [by[r]["max"] for r in rounds], alpha=0.15, color=line.get_color()
        )
        for curve in g.get("curves", {}).get(key, []):
            if curve:
                xs, ys = zip(*curve)
                ax.plot(xs, ys, linewidth=0.7, alpha=0.6, color=line.get_color())
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(f"{key}: mean per round (thick), each run (thin); band: min to max over runs", fontsize=9)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(key)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write(summary: dict, out_dir: Path) -> Path:
    """compare.json, tensorboard/ (mean and sd per round, one run per group) and index.html."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    from torch.utils.tensorboard import SummaryWriter

    for label, g in summary["groups"].items():
        with SummaryWriter(str(out_dir / "tensorboard" / label)) as tb:
            for key, by in g["rounds"].items():
                for r, b in by.items():
                    tb.add_scalar(f"{key}/mean", b["mean"], int(r))
                    tb.add_scalar(f"{key}/sd", b["std"], int(r))
    parts = [f"<h1>plait compare</h1><pre>{html.escape(describe(summary))}</pre>"]
    for key in (*HEADLINE, f"eval/{summary['metric']}"):
        png = figure(summary, key)
        if png is not None:
            data = base64.b64encode(png).decode()
            parts.append(
                f"<h2>{html.escape(key)}</h2><img alt='{html.escape(key)}' src='data:image/png;base64,{data}'>"
            )
    page = out_dir / "index.html"
    page.write_text("<!doctype html><meta charset='utf-8'><title>plait compare</title>" + "".join(parts) + "\n")
    return page


def compare(paths: list[Path], out_dir: Path, metric: str | None = None) -> tuple[dict, Path]:
    groups = [read_group(p) for p in paths]
    labels = [g.label for g in groups]
    if len(set(labels)) < len(labels):  # two folders of one name: number them
        for i, g in enumerate(groups):
            g.label = f"{i + 1}:{g.label}"
    metric = metric or next(
        (k for f in groups[0].finals for k in f if k not in ("tag", "round", "step", "n")), HEADLINE[0]
    )
    summary = summarize(groups, metric)
    return summary, write(summary, out_dir)
