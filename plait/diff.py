"""`plait diff RUN_A RUN_B`: where two runs part.

Two runs of one config and seed on one machine are the same run, bit for bit; on two CPU kinds,
or after a change, they part somewhere. This finds the first round whose metrics differ and,
among that round's metrics, the earliest stage of the round that differs: generation (what was
sampled), scoring (rewards), loss (the trainer's log-probs, ratios, clipping) or optimizer
(gradient norm, learning rate). Measurements of speed and memory are never compared.

Metrics are rounded summaries: two runs can agree on them and still differ. The per-round hashes
(hashes.jsonl: sampled tokens, rewards, advantages in every run; the first gradient and the
weights under train.deterministic) find the first stage that computed other bits. Where both
runs kept a checkpoint of the same round, their weights are compared too (local and ddp
checkpoints: model.safetensors), bit for bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from plait.train.hashes import STAGES as HASH_STAGES
from plait.types import round_of


# in the order a round computes them; a metric belongs to the first stage with a matching prefix
STAGES = (
    ("generation", ("completion/", "tokens/generated", "rollout/", "tools/", "flops/")),
    ("scoring", ("reward/", "accuracy", "groups/", "sampling/", "two_stage/", "sandbox/")),
    ("loss", ("logprob_gap", "engine/", "loss", "clip/", "ratio/", "entropy", "kl", "tokens/trained_share")),
    ("optimizer", ("grad_norm", "lr", "nonfinite_steps", "ref_syncs")),
)
# what each stage plait.train.hashes records (HASH_STAGES, in round order) hashes
HASH_MEANING = {
    "generation": "the sampled token ids or the engine's log-probs",
    "scoring": "the rewards",
    "advantages": "the advantages",
    "loss": "the gradients of the round's first update",
    "optimizer": "the weights after the round",
}
# how long, how fast, how much memory: they differ between any two runs
MEASURED = ("time/", "tokens/s_", "mfu/", "memory/", "comm/", "weight_sync/", "async/seconds_", "async/generator_")


class DiffError(ValueError):
    """A run directory without the files plait diff reads."""


def stage_of(metric: str) -> str:
    for stage, prefixes in STAGES:
        if metric.startswith(prefixes):
            return stage
    return "other"


def compared(metric: str) -> bool:
    timed = metric.endswith(("/seconds", "_seconds"))  # a reward's seconds, the tool calls' (tools/call_seconds)
    return not (metric.startswith(MEASURED) or timed or metric in ("round", "step"))


def same(a, b, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b if rtol == 0 else math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
    return a == b


@dataclass
class Parting:
    """Where two runs part: `round` None when every compared round agrees."""

    rounds_compared: int
    round: int | None = None
    stage: str | None = None
    differing: dict[str, tuple] = field(default_factory=dict)  # metric -> (a, b), at `round`
    unshared: dict[str, list[str]] = field(default_factory=dict)  # run label -> metrics only it logged
    only_in: dict[str, list[int]] = field(default_factory=dict)  # run label -> rounds the other lacks
    weights: list[tuple[int, bool]] = field(default_factory=list)  # (round, equal) of shared checkpoints
    hashes: HashParting | None = None  # None: a run has no hashes.jsonl


@dataclass
class HashParting:
    """Where the per-round hashes part: `round` None when every shared round agrees."""

    rounds_compared: int
    stages: list[str]  # hashed by both runs
    round: int | None = None
    stage: str | None = None
    # the `completions` record (token ids whatever the process count): rounds both recorded, and
    # the first whose completions differ (None: all the same)
    completions_compared: int = 0
    completions_part: int | None = None


def metrics_by_round(run_dir: Path) -> dict[int, dict]:
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        raise DiffError(f"{run_dir}: no metrics.jsonl (is it a plait run directory?)")
    rows: dict[int, dict] = {}
    for line in f.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[round_of(row)] = row
    return rows


def first_parting(a: dict[int, dict], b: dict[int, dict], rtol: float = 0.0) -> Parting:
    """The first round (of those both logged) whose compared metrics differ."""
    shared = sorted(set(a) & set(b))
    out = Parting(len(shared), only_in={"A": sorted(set(a) - set(b)), "B": sorted(set(b) - set(a))})
    keys_a = {k for r in shared for k in a[r] if compared(k)}
    keys_b = {k for r in shared for k in b[r] if compared(k)}
    out.unshared = {"A": sorted(keys_a - keys_b), "B": sorted(keys_b - keys_a)}  # e.g. another plait version's
    for r in shared:
        keys = [k for k in sorted(set(a[r]) & set(b[r])) if compared(k)]
        diff = {k: (a[r][k], b[r][k]) for k in keys if not same(a[r][k], b[r][k], rtol)}
        if diff:
            order = [s for s, _ in STAGES] + ["other"]
            out.round, out.differing = r, diff
            out.stage = min((stage_of(k) for k in diff), key=order.index)
            return out
    return out


def hashes_by_round(run_dir: Path) -> dict[int, dict] | None:
    f = Path(run_dir) / "hashes.jsonl"
    if not f.is_file():
        return None
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return {round_of(row): row for row in rows}


def first_hash_parting(a: dict[int, dict], b: dict[int, dict]) -> HashParting:
    """The first round, and stage in round order, whose hashes differ (stages either run did
    not hash are skipped)."""
    shared = sorted(set(a) & set(b))
    stages = [s for s in HASH_STAGES if any(a[r].get(s) is not None and b[r].get(s) is not None for r in shared)]
    out = HashParting(len(shared), stages)
    both = [r for r in shared if a[r].get("completions") is not None and b[r].get("completions") is not None]
    out.completions_compared = len(both)
    out.completions_part = next((r for r in both if a[r]["completions"] != b[r]["completions"]), None)
    for r in shared:
        for stage in stages:
            ha, hb = a[r].get(stage), b[r].get(stage)
            if ha is not None and hb is not None and ha != hb:
                out.round, out.stage = r, stage
                return out
    return out


def checkpoint_weights(run_dir: Path) -> dict[int, Path]:
    found = {}
    for f in (Path(run_dir) / "checkpoints").glob("step_*/model.safetensors"):
        if (f.parent / "COMMITTED").is_file():
            found[int(f.parent.name.removeprefix("step_"))] = f
    return found


def weights_equal(fa: Path, fb: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(str(fa)), load_file(str(fb))
    return wa.keys() == wb.keys() and all(wa[k].dtype == wb[k].dtype and bool((wa[k] == wb[k]).all()) for k in wa)


def diff_runs(run_a: Path, run_b: Path, rtol: float = 0.0) -> Parting:
    parting = first_parting(metrics_by_round(run_a), metrics_by_round(run_b), rtol)
    ca, cb = checkpoint_weights(run_a), checkpoint_weights(run_b)
    parting.weights = [(r, weights_equal(ca[r], cb[r])) for r in sorted(set(ca) & set(cb))]
    ha, hb = hashes_by_round(run_a), hashes_by_round(run_b)
    if ha is not None and hb is not None:
        parting.hashes = first_hash_parting(ha, hb)
    return parting


def describe(p: Parting, rtol: float = 0.0, shown: int = 8) -> str:
    how = "bit for bit" if rtol == 0 else f"within rel. tolerance {rtol:g}"
    lines = []
    if p.rounds_compared == 0:
        lines.append("no round was logged by both runs")
    elif p.round is None:
        lines.append(
            f"the runs agree on all {p.rounds_compared} rounds both logged ({how}; speed and memory not compared)"
        )
    else:
        agree = f"agree on rounds before {p.round}" if p.round > 1 else "differ from round 1"
        lines.append(f"the runs {agree} and part at round {p.round}, first in its {p.stage} stage ({how}):")
        order = [s for s, _ in STAGES] + ["other"]
        for k, (va, vb) in sorted(p.differing.items(), key=lambda kv: (order.index(stage_of(kv[0])), kv[0]))[:shown]:
            lines.append(f"  {stage_of(k):<10} {k}: {va!r} vs {vb!r}")
        if len(p.differing) > shown:
            lines.append(f"  ... and {len(p.differing) - shown} more metric(s)")
    for label, rounds in p.only_in.items():
        if rounds:
            lines.append(f"only run {label} logged rounds {rounds[0]}..{rounds[-1]} ({len(rounds)})")
    for label, keys in p.unshared.items():
        if keys:
            more = " ..." if len(keys) > 8 else ""
            lines.append(f"only run {label} logged (not compared): {', '.join(keys[:8])}{more}")
    h = p.hashes
    if h is not None and h.rounds_compared:
        if h.round is None:
            lines.append(f"hashes ({', '.join(h.stages)}): equal on all {h.rounds_compared} rounds both hashed")
        else:
            lines.append(
                f"hashes: the runs part at round {h.round}, first in its {h.stage} stage "
                f"({HASH_MEANING[h.stage]} differ; stages hashed by both: {', '.join(h.stages)})"
            )
    if h is not None and h.completions_compared:
        what = "sampled completions (token ids, whatever the process count)"
        if h.completions_part is None:
            lines.append(f"{what}: the same in all {h.completions_compared} rounds both recorded")
        else:
            lines.append(f"{what}: first differ at round {h.completions_part}")
    if p.weights:
        equal = [r for r, eq in p.weights if eq]
        parted = [r for r, eq in p.weights if not eq]
        lines.append(
            "checkpoint weights: "
            + (f"equal at round(s) {equal}" if equal else "none equal")
            + (f"; differ at round(s) {parted}" if parted else "")
        )
    return "\n".join(lines)
