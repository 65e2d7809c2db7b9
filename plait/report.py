"""`plait report RUN_DIR`: one self-contained HTML page (figures inlined, no CDN, no script)
plus the same figures as PNG files, from what a run wrote: metrics.jsonl, eval.jsonl,
samples.jsonl, config.yaml and cluster.json."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.ticker


matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402

from plait.telemetry.advice import health_notes, suggestion  # noqa: E402
from plait.train.metrics import phase_summary  # noqa: E402
from plait.types import round_of  # noqa: E402


PHASE_COLORS = {
    "generate": "#4c72b0",
    "wait_for_rollout": "#8da0cb",
    "weight_sync": "#64b5cd",
    "score": "#55a868",
    "logprobs": "#8172b3",
    "teacher": "#a6761d",
    "train": "#c44e52",
    "optimizer": "#dd8452",
    "checkpoint": "#937860",
    "eval": "#da8bc3",
    "idle": "#bbbbbb",
}


class ReportError(RuntimeError):
    pass


def read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of a file (a torn last line from a crash is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


@dataclass
class Figure:
    name: str
    title: str
    png: bytes


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(rounds, values) where the metric is present and finite."""
    pts = [(round_of(m), m[key]) for m in history if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _lines(ax, history, keys: list[tuple[str, str]], ylabel: str) -> bool:
    drawn = False
    for key, label in keys:
        x, y = series(history, key)
        if x:
            ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label=label)
            drawn = True
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    return drawn


def fig_rewards(history, evals, metric: str) -> bytes | None:
    x, mean = series(history, "reward/total/mean")
    if not x:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    _, std = series(history, "reward/total/std")
    ax.plot(x, mean, color="black", label="total (weighted)")
    if len(std) == len(mean):
        low, high = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
        ax.fill_between(x, low, high, color="black", alpha=0.1)
    names = {k.split("/")[1] for m in history for k in m if k.startswith("reward/") and k.endswith("/mean")}
    names = sorted(names - {"total"})
    _lines(ax, history, [(f"reward/{n}/mean", n) for n in names], "reward")
    ax.set_title("reward per round (mean, band = ±1 std of total)")
    _lines(ax2, history, [("accuracy", f"{metric} on training samples")], "accuracy")
    ev = [(round_of(e), e[metric]) for e in evals if metric in e]
    if ev:
        ax2.plot(
            [s for s, _ in ev], [v for _, v in ev], "D", color="C3", ms=7, label=f"held-out eval ({metric}, greedy)"
        )
        ax2.legend(fontsize=8)
    for i, at in enumerate(rollback_rounds(history)):
        ax2.axvline(at, color="C1", ls=":", label="recovery: rolled back" if i == 0 else None)
        ax2.legend(fontsize=8)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("accuracy")
    return _png(fig)


def rollback_rounds(history: list[dict]) -> list[int]:
    """The rounds after which recovery rolled back (a round's record counts the rollbacks before it)."""
    counts = [(round_of(m), m["recovery/rollbacks"]) for m in history if "recovery/rollbacks" in m]
    return [r - 1 for (r, n), (_, before) in zip(counts[1:], counts) if n > before]


def fig_length(history) -> bytes | None:
    if not series(history, "completion/length_mean")[0]:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.4))
    _lines(ax, history, [("completion/length_mean", "mean length"), ("completion/length_max", "max length")], "tokens")
    ax2 = ax.twinx()
    x, y = series(history, "completion/truncated")
    ax2.plot(x, y, color="C3", ls="--", label="truncated share (right axis)")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("truncated share", color="C3")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=8)
    ax.set_title("completion length and truncation")
    return _png(fig)


def fig_policy(history) -> bytes | None:
    if not series(history, "clip/fraction")[0]:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    clips = [("clip/fraction", "clipped"), ("clip/low", "clipped low"), ("clip/high", "clipped high")]
    _lines(ax, history, clips, "share of tokens")
    ax.set_title("clip fraction")
    per_token = [
        ("kl", "KL to reference"),
        ("teacher/kl", "KL to teacher"),
        ("teacher/top_k_kl", "KL from teacher's top k"),
        ("entropy", "entropy"),
        ("logprob_gap", "|engine - trainer| log-prob"),
    ]
    drawn = _lines(ax2, history, per_token, "nats / token")
    ax2.set_title("KL, entropy, engine mismatch" if drawn else "KL (beta = 0: no reference)")
    return _png(fig)


def fig_time(history) -> bytes | None:
    phases = [p for p in PHASE_COLORS if any(f"time/{p}" in m for m in history)]
    phases += sorted({k[5:] for m in history for k in m if k.startswith("time/")} - set(phases) - {"step"})
    if not phases:
        return None
    steps = [round_of(m) for m in history]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    bottom = [0.0] * len(steps)
    for p in phases:
        vals = [m.get(f"time/{p}") or 0.0 for m in history]
        ax.bar(steps, vals, bottom=bottom, color=PHASE_COLORS.get(p), label=p, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.set_title("where each step's time went")
    ax.legend(fontsize=8, ncol=min(5, len(phases)), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def fig_throughput(history) -> bytes | None:
    if not series(history, "tokens/s_generate")[0]:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    rates = [("tokens/s_generate", "generated tokens/s"), ("tokens/s_train", "trained tokens/s (prompt + completion)")]
    _lines(ax, history, rates, "tokens / s")
    ax.set_title("throughput")
    mfus = sorted({k for m in history for k in m if k.startswith("mfu/")})
    if _lines(ax2, history, [(k, k[4:]) for k in mfus], "MFU"):
        ax2.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    else:
        ax2.text(
            0.5,
            0.5,
            "no MFU recorded\n(unknown device peak: set log.peak_flops)",
            ha="center",
            va="center",
            transform=ax2.transAxes,
        )
    ax2.set_title("model FLOPs utilization")
    return _png(fig)


def fig_async(history) -> bytes | None:
    """Asynchronous generation: how stale the samples were, and where the producer's time went."""
    if not series(history, "async/scheduled_version")[0]:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    stale = [("rollout/staleness_mean", "mean"), ("rollout/weight_staleness", "max")]
    _lines(ax, history, stale, "versions behind the trainer")
    ax.set_title("staleness of the trained samples")
    phases = [("generate", "generate"), ("score", "score"), ("weight_push", "weight push")]
    waits = [("time/wait_for_rollout", "trainer waiting")]
    _lines(ax2, history, [(f"async/seconds_{k}", v) for k, v in phases] + waits, "seconds per round")
    ax2.set_title("the producer's time, and the trainer's wait")
    return _png(fig)


def fig_tools(history) -> bytes | None:
    """Multi-turn tool use: how often the model calls, and how the calls go."""
    if not series(history, "tools/calls_per_completion")[0]:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    use = [("tools/calls_per_completion", "calls per completion"), ("tools/turns_mean", "model turns per completion")]
    _lines(ax, history, use + [("tools/used_share", "share of completions with a call")], "per completion")
    ax.set_title("tool use")
    _lines(ax2, history, [("tools/error_share", "share of calls that failed or timed out")], "share")
    ax2.set_title("tool errors")
    return _png(fig)


def fig_agent(history) -> bytes | None:
    """An agent as the rollout (rollout.agent): its calls per rollout, and how its rollouts and
    calls went (failed, on samples it left, given no token by the budget)."""
    if not series(history, "agent/calls_per_rollout")[0]:
        return None
    rows = [{**m, **_agent_shares(m)} for m in history]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    _lines(ax, rows, [("agent/calls_per_rollout", "calls per rollout"), ("forks", "forks per rollout")], "per rollout")
    ax.set_title("agent calls")
    shares = [
        ("agent/error_share", "share of rollouts that failed"),
        ("forked", "share of calls on samples it left (not trained)"),
        ("out_of_budget", "share of calls the token budget left nothing for"),
    ]
    _lines(ax2, rows, shares, "share")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("agent failures, forks and spent budgets")
    return _png(fig)


def _agent_shares(m: dict) -> dict[str, float]:
    """A round's agent counts as shares (none where the round has no agent rollouts)."""
    rollouts, calls = m.get("agent/rollouts"), m.get("agent/calls")
    if not rollouts:
        return {}
    out = {"forks": m.get("agent/forks", 0.0) / rollouts}
    if calls:
        out["forked"] = m.get("agent/forked_calls", 0.0) / calls
        if "agent/calls_out_of_budget" in m:  # (runs before it was counted have none)
            out["out_of_budget"] = m["agent/calls_out_of_budget"] / calls
    return out


def fig_environments(history, evals) -> bytes | None:
    """Per environment: the verifier's mean score on the training samples, held-out scores
    as diamonds, and the share of completions its verifier failed on."""
    labels = sorted({k.split("/")[1] for m in history for k in m if k.startswith("env/") and k.endswith("/score_mean")})
    if not labels:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    _lines(ax, history, [(f"env/{label}/score_mean", label) for label in labels], "verifier score")
    for i, label in enumerate(labels):
        ev = [(round_of(e), e[f"env/{label}"]) for e in evals if f"env/{label}" in e]
        ax.plot([r for r, _ in ev], [v for _, v in ev], "D", color=f"C{i}", ms=7)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("verifier score (line: samples, diamond: held-out)")
    errors = [
        {
            "round": round_of(m),
            **{
                label: m.get(f"env/{label}/errors", 0) / max(1, m.get(f"env/{label}/completions", 0))
                for label in labels
            },
        }
        for m in history
    ]
    _lines(ax2, errors, [(label, label) for label in labels], "share")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("completions the verifier failed on")
    return _png(fig)


def fig_memory(history) -> bytes | None:
    keys = sorted({k for m in history for k in m if k.startswith("memory/")})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.2))
    _lines(ax, history, [(k, k[7:]) for k in keys], "GiB (the fullest process)")
    ax.set_title("memory per step")
    return _png(fig)


def make_figures(history: list[dict], evals: list[dict], metric: str) -> list[Figure]:
    made = [
        ("rewards", "Reward and accuracy", fig_rewards(history, evals, metric)),
        ("length", "Completion length and truncation", fig_length(history)),
        ("policy", "Clip fraction, KL and entropy", fig_policy(history)),
        ("time", "Time per phase", fig_time(history)),
        ("throughput", "Throughput and MFU", fig_throughput(history)),
        ("async", "Asynchronous generation", fig_async(history)),
        ("tools", "Tool use (tools/calls_per_completion, tools/used_share, tools/error_share)", fig_tools(history)),
        ("agent", "Agent (agent/calls_per_rollout, agent/error_share, agent/calls_out_of_budget)", fig_agent(history)),
        ("environments", "Environments (env/<label>/score_mean, env/<label>/errors)", fig_environments(history, evals)),
        ("memory", "Memory", fig_memory(history)),
    ]
    return [Figure(n, t, png) for n, t, png in made if png is not None]


# ---------------------------------------------------------------- the page

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;
margin:2em auto;max-width:1180px;color:#222;padding:0 1em}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:.9em}
td,th{border:1px solid #ddd;padding:4px 8px;vertical-align:top;text-align:left}
th{background:#f5f5f5} .num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%} pre{background:#f7f7f7;padding:.8em;overflow:auto;font-size:.85em}
.tip{background:#fff6d6;border-left:4px solid #e0b000;padding:.5em .8em} .muted{color:#777}
td.text{white-space:pre-wrap;font-family:ui-monospace,monospace;max-width:460px}
"""


def _conversation(sample: dict) -> str:
    """A sample's completion; a multi-turn one turn by turn, each under its role."""
    turns = sample.get("conversation")
    if not turns:
        return _esc(sample.get("completion", ""))
    return "\n".join(f"<b>[{_esc(t.get('role'))}]</b>\n{_esc(t.get('content', ''))}" for t in turns)


def _esc(v) -> str:
    return html.escape(str(v))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return _esc(v)


def summary_rows(history: list[dict], evals: list[dict], metric: str) -> list[tuple[str, str]]:
    total, shares = phase_summary(history)
    rows = [
        ("steps", str(len(history))),
        ("step time, total", f"{total:.0f} s ({total / max(1, len(history)):.1f} s per step)"),
    ]
    rows.append(("time per phase", ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))))
    before = [e[metric] for e in evals if e.get("tag") == "before" and metric in e]
    after = [e for e in evals if e.get("tag") == "after" and metric in e]
    if before or after:
        first, final = before[-1] if before else "-", after[-1][metric] if after else "-"
        restored = after[-1].get("restored") if after else None
        state = "" if restored is None else f" (round {restored}'s state, restored by recovery)"
        rows.append((f"held-out {metric}", f"{first} before -> {final} after{state}"))
    rolled = rollback_rounds(history)
    if any("recovery/rollbacks" in m for m in history):
        scale = history[-1].get("recovery/lr_scale", 1.0)
        at = f" after round(s) {', '.join(map(str, rolled))}" if rolled else ""
        rows.append(("recovery", f"{len(rolled)} rollback(s){at}; learning rate x{scale:g}"))
    last = history[-5:]
    for key, label in [
        ("reward/total/mean", "reward (mean of last 5 steps)"),
        ("mfu/train", "MFU, train (last 5)"),
        ("tokens/s_generate", "generated tokens/s (last 5)"),
        ("memory/peak_rss_gb", "peak host RSS, GiB"),
    ]:
        vals = [m[key] for m in last if isinstance(m.get(key), (int, float))]
        if vals:
            v = max(vals) if key.startswith("memory/") else sum(vals) / len(vals)
            rows.append((label, f"{v:.1%}" if key.startswith("mfu/") else _fmt(v)))
    return rows


def render(
    run_dir: Path,
    figures: list[Figure],
    history,
    evals,
    samples,
    config_text: str,
    cluster,
    tip,
    metric,
    health: list[str] | None = None,
) -> str:
    parts = [
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>plait report: {_esc(run_dir.name)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>plait run report</h1><p class='muted'>{_esc(run_dir.resolve())}</p>",
        "<h2>Summary</h2><table id='summary'>",
    ]
    parts += [f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in summary_rows(history, evals, metric)]
    parts.append("</table>")
    if tip:
        parts.append(f"<p class='tip' id='suggestion'><b>Suggestion:</b> {_esc(tip)}</p>")
    for note in health or []:
        parts.append(f"<p class='tip health'><b>Learning:</b> {_esc(note)}</p>")
    for f in figures:
        data = base64.b64encode(f.png).decode()
        parts.append(
            f"<h2>{_esc(f.title)}</h2><img class='figure' id='fig-{f.name}' alt='{_esc(f.title)}' "
            f"src='data:image/png;base64,{data}'>"
        )
    if evals:
        parts.append(
            "<h2>Evaluations</h2><table id='evals'><tr><th>when</th><th>step</th>"
            f"<th>{_esc(metric)}</th><th>prompts</th></tr>"
        )
        parts += [
            f"<tr><td>{_esc(e.get('tag'))}</td><td class='num'>{_esc(e.get('step'))}</td>"
            f"<td class='num'>{_fmt(e.get(metric, '-'))}</td><td class='num'>{_esc(e.get('n', '-'))}</td></tr>"
            for e in evals
        ]
        parts.append("</table>")
    parts.append(
        f"<h2>Sample completions</h2><p class='muted'>{len(samples)} logged "
        "(every log.sample_every_steps steps); the last 60 shown.</p>"
    )
    if samples:
        names = sorted({k for s in samples for k in s.get("rewards", {})})
        parts.append(
            "<table id='samples'><tr><th>step</th><th>prompt</th><th>completion</th><th>answer</th>"
            + "".join(f"<th>{_esc(n)}</th>" for n in names)
            + "</tr>"
        )
        for s in samples[-60:]:
            cells = "".join(f"<td class='num'>{_fmt(s['rewards'].get(n, '-'))}</td>" for n in names)
            parts.append(
                f"<tr><td class='num'>{_esc(s.get('step'))}</td><td class='text'>{_esc(s.get('prompt', ''))}</td>"
                f"<td class='text'>{_conversation(s)}</td><td>{_esc(s.get('answer'))}</td>{cells}</tr>"
            )
        parts.append("</table>")
    if cluster:
        keys = sorted({k for p in cluster for k in p})
        head = "".join(f"<th>{_esc(k)}</th>" for k in keys)
        parts.append(f"<h2>Processes</h2><table id='processes'><tr>{head}</tr>")
        parts += ["<tr>" + "".join(f"<td>{_fmt(p.get(k, ''))}</td>" for k in keys) + "</tr>" for p in cluster]
        parts.append("</table>")
    parts.append(f"<h2>Configuration</h2><pre id='config'>{_esc(config_text)}</pre></body></html>")
    return "\n".join(parts)


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write OUT_DIR/index.html and OUT_DIR/figures/*.png (OUT_DIR = RUN_DIR/report); returns the page."""
    run_dir = Path(run_dir)
    history = read_jsonl(run_dir / "metrics.jsonl")
    if not history:
        raise ReportError(
            f"{run_dir} has no metrics.jsonl with a finished step: is it a plait run directory (runs/NAME-TIME)?"
        )
    config_text = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").exists() else ""
    cfg = None
    if config_text:
        from plait.config import ConfigError, load_config

        try:
            cfg = load_config(run_dir / "config.yaml")
        except (ConfigError, ValueError):
            cfg = None  # a config from another plait version: the page goes on without the suggestion
    metric = cfg.eval.metric if cfg is not None else "accuracy"
    evals, samples = read_jsonl(run_dir / "eval.jsonl"), read_jsonl(run_dir / "samples.jsonl")
    cluster = json.loads((run_dir / "cluster.json").read_text()) if (run_dir / "cluster.json").exists() else []
    out_dir = Path(out_dir or run_dir / "report")
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    figures = make_figures(history, evals, metric)
    for f in figures:
        (out_dir / "figures" / f"{f.name}.png").write_bytes(f.png)
    tip = suggestion(phase_summary(history)[1], cfg) if cfg is not None else None
    health = health_notes(history, evals, cfg, metric)
    page = out_dir / "index.html"
    page.write_text(render(run_dir, figures, history, evals, samples, config_text, cluster, tip, metric, health))
    return page
