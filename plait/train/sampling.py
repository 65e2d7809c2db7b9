"""One step's groups: generate, score, and (with DAPO's dynamic sampling) keep only the
groups that can teach something, refilling with new prompts for a bounded number of rounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from plait.rewards.runner import BoundReward, score_groups
from plait.train.metrics import informative
from plait.types import Group, Prompt, SamplingParams


def sampling_params(cfg, step: int, round_: int = 0) -> SamplingParams:
    """Step `step`'s sampling: its own seed, so a resumed run draws the same completions."""
    r = cfg.rollout
    seed = cfg.seed * 1_000_003 + step + 100_003 * round_
    return SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k, list(r.stop), seed=seed)


@dataclass
class SamplingStats:
    rounds: int = 0
    generated_groups: int = 0
    kept_informative: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "sampling/rounds": float(self.rounds),
            "sampling/generated_groups": float(self.generated_groups),
            "sampling/informative_kept": float(self.kept_informative),
        }


def collect_groups(
    engine,
    take: Callable[[int], list[Prompt]],
    n_prompts: int,
    cfg,
    step: int,
    rewards: list[BoundReward],
    timer,
) -> tuple[list[Group], SamplingStats]:
    """`n_prompts` scored groups. Without dynamic sampling: one generation round. With it:
    rounds of fresh prompts until n_prompts informative groups are found or
    `max_sampling_rounds` is reached; the shortfall is then filled with uninformative groups
    (they contribute zero advantage) and the stats say so."""
    a = cfg.algo
    stats = SamplingStats()
    kept: list[Group] = []
    spare: list[Group] = []
    while True:
        prompts = take(n_prompts - len(kept))
        with timer("generate"):
            outs = engine.generate(prompts, sampling_params(cfg, step, stats.rounds), n=cfg.rollout.num_generations)
        groups = [Group(p, cs) for p, cs in zip(prompts, outs)]
        with timer("score"):
            score_groups(groups, rewards)  # raises RewardError naming the function and sample
        stats.rounds += 1
        stats.generated_groups += len(groups)
        if not a.dynamic_sampling:
            return groups, stats
        kept += [g for g in groups if informative(g)]
        spare += [g for g in groups if not informative(g)]
        if len(kept) >= n_prompts or stats.rounds >= a.max_sampling_rounds:
            break
    stats.kept_informative = min(len(kept), n_prompts)
    return (kept + spare)[:n_prompts], stats
