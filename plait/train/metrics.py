"""Per-step numbers about the rollouts (rewards, lengths, truncation) for the metrics line."""

from __future__ import annotations

import statistics

from plait.types import Group


def informative(group: Group) -> bool:
    """A group teaches something only if its rewards differ (else every advantage is 0)."""
    return len(set(group.total)) > 1


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def rollout_metrics(groups: list[Group], accuracy: list[float] | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    names = list(groups[0].rewards) if groups else []
    for name in names:
        vals = [v for g in groups for v in g.rewards[name] if v is not None]
        out[f"reward/{name}/mean"], out[f"reward/{name}/std"] = _mean_std(vals)
    totals = [v for g in groups for v in g.total]
    out["reward/total/mean"], out["reward/total/std"] = _mean_std(totals)
    out["groups/all_equal"] = sum(not informative(g) for g in groups) / max(1, len(groups))
    lengths = [len(c.token_ids) for g in groups for c in g.completions]
    out["completion/length_mean"] = statistics.fmean(lengths) if lengths else 0.0
    out["completion/length_max"] = float(max(lengths, default=0))
    out["completion/truncated"] = sum(c.truncated for g in groups for c in g.completions) / max(1, len(lengths))
    out["tokens/generated"] = float(sum(lengths))
    if accuracy is not None:
        out["accuracy"] = statistics.fmean(accuracy) if accuracy else float("nan")
    return out


def sample_record(step: int, group: Group) -> dict:
    """The first completion of a group with its rewards, for samples.jsonl and the console."""
    c = group.completions[0]
    return {
        "step": step,
        "prompt": group.prompt.text,
        "answer": group.prompt.answer,
        "completion": c.text,
        "rewards": {k: v[0] for k, v in group.rewards.items()},
    }


def phase_summary(history: list[dict]) -> tuple[float, dict[str, float]]:
    """Total step seconds and each phase's share of it over the whole run."""
    total = sum(m.get("time/step", 0.0) for m in history)
    phases: dict[str, float] = {}
    for m in history:
        for k, v in m.items():
            if k.startswith("time/") and k != "time/step":
                phases[k[5:]] = phases.get(k[5:], 0.0) + v
    return total, {k: v / total for k, v in phases.items()} if total else {}
