"""Per-step numbers about the rollouts (rewards, lengths, truncation) for the metrics line,
over every training process."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import torch

from plait import comm
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
    out["reward/total/max"] = max(totals, default=float("nan"))  # what the reward can pay, as far as seen
    out["groups/all_equal"] = sum(not informative(g) for g in groups) / max(1, len(groups))
    if accuracy is not None:
        out.update(equal_groups_by_value(groups, accuracy))
    lengths = [len(c.token_ids) for g in groups for c in g.completions]
    out["completion/length_mean"] = statistics.fmean(lengths) if lengths else 0.0
    out["completion/length_max"] = float(max(lengths, default=0))
    out["completion/truncated"] = sum(c.truncated for g in groups for c in g.completions) / max(1, len(lengths))
    out["tokens/generated"] = float(sum(_sampled(c) for g in groups for c in g.completions))
    out.update(tool_metrics([c for g in groups for c in g.completions]))
    out.update(environment_metrics(groups))
    if accuracy is not None:
        out["accuracy"] = statistics.fmean(accuracy) if accuracy else float("nan")
    return out


def equal_groups_by_value(groups: list[Group], accuracy: list[float]) -> dict[str, float]:
    """Shares of the groups whose every completion was right (accuracy 1) or wrong (0): equal
    groups teach nothing either way, but all right is a solved prompt and all wrong a dead one."""
    right = wrong = start = 0
    for g in groups:
        values = accuracy[start : start + len(g.completions)]
        start += len(g.completions)
        right += bool(values) and all(v >= 1.0 for v in values)
        wrong += bool(values) and all(v <= 0.0 for v in values)
    n = max(1, len(groups))
    return {"groups/all_right": right / n, "groups/all_wrong": wrong / n}


def environment_metrics(groups: list[Group]) -> dict[str, float]:
    """Per environment (the prompts' `environment` column): mean summed reward, the verifier's
    mean score, completion length, and the completions its verifier failed on (None: an
    infrastructure error, trained on as nothing)."""
    by_env: dict[str, list[Group]] = {}
    for g in groups:
        label = g.prompt.columns.get("environment")
        if label is not None:
            by_env.setdefault(str(label), []).append(g)
    out: dict[str, float] = {}
    for label, gs in sorted(by_env.items()):
        completions = [c for g in gs for c in g.completions]
        scores = [v for g in gs for v in g.rewards.get("environment", [])]
        if not scores:  # trl_env rollouts scored by the config's own rewards: what get_reward said
            scores = [
                None if c.env_error else c.env_reward for c in completions if c.env_reward is not None or c.env_error
            ]
        scored = [v for v in scores if v is not None]
        out[f"env/{label}/reward_mean"] = statistics.fmean(v for g in gs for v in g.total)
        out[f"env/{label}/score_mean"] = statistics.fmean(scored) if scored else float("nan")
        out[f"env/{label}/length_mean"] = statistics.fmean(len(c.token_ids) for c in completions)
        out[f"env/{label}/completions"] = float(len(completions))
        out[f"env/{label}/errors"] = float(len(scores) - len(scored))
    return out


def _sampled(c) -> int:
    """Tokens the model sampled (a multi-turn completion also holds tool output)."""
    return len(c.token_ids) if c.sampled_mask is None else sum(c.sampled_mask)


def tool_metrics(completions: list) -> dict[str, float]:
    """Multi-turn tool use over a round's completions (none without rollout.tools)."""
    stats = [c.info for c in completions if c.info and "tools/calls" in c.info]
    if not stats:
        return {}
    n = len(stats)
    calls = sum(s["tools/calls"] for s in stats)
    return {
        "tools/calls_per_completion": calls / n,
        "tools/used_share": sum(s["tools/calls"] > 0 for s in stats) / n,
        "tools/turns_mean": sum(s["tools/turns"] for s in stats) / n,
        "tools/errors": sum(s["tools/errors"] for s in stats),
        "tools/timeouts": sum(s["tools/timeouts"] for s in stats),
        "tools/error_share": sum(s["tools/errors"] + s["tools/timeouts"] for s in stats) / calls if calls else 0.0,
        "tools/call_seconds": sum(s["tools/seconds"] for s in stats),
        "tools/output_tokens": float(sum(len(c.token_ids) - _sampled(c) for c in completions)),
    }


def agent_counts(groups: list[Group]) -> dict[str, float]:
    """This process's agent rollouts (rollout.agent): rollouts, calls, forks, calls on samples
    left behind, failures, calls the token budget left nothing for (none without an agent);
    summed over processes before `agent_rates`."""
    stats = [c.info for g in groups for c in g.completions if c.info and "agent/calls" in c.info]
    if not stats:
        return {}
    keys = ("calls", "forks", "forked_calls", "errors", "calls_out_of_budget")
    # .get: rounds a checkpoint held from before a count existed
    out = {f"agent/{k}": float(sum(s.get(f"agent/{k}", 0.0) for s in stats)) for k in keys}
    return {**out, "agent/rollouts": float(len(stats))}


def agent_rates(totals: dict[str, float]) -> dict[str, float]:
    n = totals.get("agent/rollouts")
    if not n:
        return {}
    return {"agent/calls_per_rollout": totals["agent/calls"] / n, "agent/error_share": totals["agent/errors"] / n}


def sample_record(round_: int, group: Group) -> dict:
    """The first completion of a group with its rewards, for samples.jsonl and the console."""
    c = group.completions[0]
    return {
        "round": round_,
        "step": round_,  # its name before; kept for one release
        "prompt": group.prompt.text,
        "answer": group.prompt.answer,
        "completion": c.text,
        # multi-turn: the model's own words, which the rewards read (the completion holds added turns too)
        **({"scored_text": c.model_text} if c.model_text is not None and c.model_text != c.text else {}),
        "rewards": {k: v[0] for k, v in group.rewards.items()},
        # the weight versions that sampled it (several: new weights arrived mid-completion)
        "weight_versions": sorted(set(c.staleness_versions)),
        **({"conversation": c.messages} if c.messages else {}),
    }


def phase_summary(history: list[dict]) -> tuple[float, dict[str, float]]:
    """Total step seconds and each phase's share of the run (the shares add up to 1; with
    several processes each phase is its slowest process's time)."""
    total = sum(m.get("time/step") or 0.0 for m in history)
    phases: dict[str, float] = {}
    for m in history:
        for k, v in m.items():
            if k.startswith("time/") and k != "time/step" and v is not None:
                phases[k[5:]] = phases.get(k[5:], 0.0) + v
    covered = sum(phases.values())
    return total, {k: v / covered for k, v in phases.items()} if covered else {}


def round_rollout_metrics(groups: list[Group], accuracy: list[float] | None) -> dict[str, float]:
    """rollout_metrics over every process's groups (gathered without their log-probs)."""
    light = [
        Group(g.prompt, [dataclasses.replace(c, logprobs=[]) for c in g.completions], g.rewards, g.total)
        for g in groups
    ]
    parts = comm.all_gather_objects((light, accuracy))
    everyone = [g for gs, _ in parts for g in gs]
    acc = None if accuracy is None else [v for _, a in parts for v in a]
    return rollout_metrics(everyone, acc)


def across_processes(*parts: dict[str, float]) -> dict[str, float]:
    """Counters summed over processes (sampling rounds: the most any process needed)."""
    merged = {k: v for p in parts for k, v in p.items()}
    keys = sorted(merged)
    totals = dict(zip(keys, comm.all_sum([merged[k] for k in keys])))
    if "sampling/rounds" in merged:
        totals["sampling/rounds"] = comm.all_max([merged["sampling/rounds"]])[0]
    return totals


def describe_processes(backend, run_dir: Path, say, final: bool = False) -> None:
    """Which process holds what (parameters, peak memory): the log and RUN_DIR/cluster.json."""
    import os
    import resource
    import socket

    mine = {
        "rank": comm.rank(),
        "host": socket.gethostname(),
        "node_id": os.environ.get("PLAIT_NODE_ID"),
        **backend.describe(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if torch.cuda.is_available():
        mine["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    everyone = comm.all_gather_objects(mine)
    if comm.is_main():
        (run_dir / "cluster.json").write_text(json.dumps(everyone, indent=1))
    if not final and len(everyone) > 1:
        held = ", ".join(f"rank {p['rank']}: {p['params_local'] / 1e6:.2f}M" for p in everyone)
        say(f"parameters held per process ({everyone[0]['params_total'] / 1e6:.2f}M in the model): {held}")
