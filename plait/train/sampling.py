"""One step's groups: generate, score, and keep the groups that can teach something.

Two ways to spend less on prompts that teach nothing:
- DAPO's dynamic sampling: generate whole groups, drop those whose rewards are all equal,
  refill with new prompts for a bounded number of rounds;
- two-stage generation (for expensive verifiers): sample a few candidates per prompt, and
  generate (and verify) the rest of the group only for prompts that pass a rule.

Both are built on `Sampler.scored`, the one place where prompts become scored groups. What
scoring cost over all of a round's sampling passes (reward seconds, timeouts, sandbox
executions) comes back on the stats as one RewardReport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from plait.rewards.runner import BoundReward, RewardReport, score_groups
from plait.train.metrics import informative
from plait.types import Group, Prompt, SamplingParams


if TYPE_CHECKING:
    from plait.sandbox.box import Sandbox


def sampling_params(cfg, step: int, pass_: int = 0) -> SamplingParams:
    """Round `step`'s sampling (pass `pass_` of it): its own seed, so a resumed run draws the
    same completions."""
    r = cfg.rollout
    seed = cfg.seed * 1_000_003 + step + 100_003 * pass_
    return SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k, list(r.stop), seed=seed)


@dataclass
class SamplingStats:
    rounds: int = 0
    generated_groups: int = 0
    kept_informative: int = 0
    # two-stage only
    two_stage: bool = False
    prompts_skipped: int = 0
    generations_saved: int = 0
    sandbox_seconds_saved: float = 0.0
    rewards: RewardReport = field(default_factory=RewardReport)  # the cost of every scoring round

    def metrics(self) -> dict[str, float]:
        out = {
            "sampling/rounds": float(self.rounds),
            "sampling/generated_groups": float(self.generated_groups),
            "sampling/informative_kept": float(self.kept_informative),
        }
        if self.two_stage:
            out["two_stage/prompts_skipped"] = float(self.prompts_skipped)
            out["two_stage/generations_saved"] = float(self.generations_saved)
            out["two_stage/sandbox_seconds_saved"] = self.sandbox_seconds_saved
        return out


def keep_for_second_stage(scores: list[float | None], rule: str, threshold: float) -> bool:
    """Does a prompt whose first candidates scored `scores` get the rest of its group?

    mixed: the candidates disagree (some correct, some not); not_all_correct: at least one
    failed; not_all_failed: at least one succeeded. None (not applicable) counts as failed.
    """
    correct = [s is not None and s >= threshold for s in scores]
    if rule == "mixed":
        return any(correct) and not all(correct)
    if rule == "not_all_correct":
        return not all(correct)
    if rule == "not_all_failed":
        return any(correct)
    raise ValueError(f"unknown two-stage rule {rule!r}")


@dataclass
class Sampler:
    """What makes a round's scored groups: the engine and the rollout program that samples
    through it, the run's config, rewards and sandbox (whose executions the RewardReport counts;
    None: the one the rewards are bound to), and the timer that books generation and scoring."""

    engine: Any
    program: Any
    cfg: Any
    rewards: list[BoundReward]
    timer: Any
    sandbox: Sandbox | None = None

    def scored(self, prompts: list[Prompt], step: int, pass_: int, n: int) -> tuple[list[Group], RewardReport]:
        """`n` completions for each prompt, sampled with round `step`'s seed for sampling pass
        `pass_`, and scored (RewardError names the function and sample)."""
        with self.timer("generate"):
            outs = self.program.run(self.engine, prompts, sampling_params(self.cfg, step, pass_), n)
        groups = [Group(p, cs) for p, cs in zip(prompts, outs)]
        with self.timer("score"):
            report = score_groups(groups, self.rewards, self.sandbox, step, self.cfg.train.max_steps)
        return groups, report

    def collect(
        self, take: Callable[[int], list[Prompt]], n_prompts: int, step: int
    ) -> tuple[list[Group], SamplingStats]:
        """Round `step`'s `n_prompts` groups, prompts drawn with `take(count)`: one sampling pass,
        or dynamic sampling's or two-stage generation's several."""
        if self.cfg.rollout.two_stage is not None:
            return collect_two_stage(self, take, n_prompts, step)
        return collect_groups(self, take, n_prompts, step)


def collect_groups(
    sampler: Sampler, take: Callable[[int], list[Prompt]], n_prompts: int, step: int
) -> tuple[list[Group], SamplingStats]:
    """`n_prompts` scored groups. Without dynamic sampling: one sampling pass. With it: passes
    of fresh prompts until n_prompts informative groups are found or `max_sampling_rounds` is
    reached; the shortfall is then filled with uninformative groups (they contribute zero
    advantage) and the stats say so."""
    a = sampler.cfg.algo
    stats = SamplingStats()
    kept: list[Group] = []
    spare: list[Group] = []
    while True:
        groups, report = sampler.scored(
            take(n_prompts - len(kept)), step, stats.rounds, sampler.cfg.rollout.num_generations
        )
        stats.rewards = stats.rewards.merge(report)
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


def _extend(group: Group, more: Group) -> Group:
    """A group with `more`'s completions and scores appended."""
    return Group(
        group.prompt,
        group.completions + more.completions,
        {k: group.rewards[k] + more.rewards[k] for k in group.rewards},
        group.total + more.total,
    )


def collect_two_stage(
    sampler: Sampler, take: Callable[[int], list[Prompt]], n_prompts: int, step: int
) -> tuple[list[Group], SamplingStats]:
    """Stage 1: `first_generations` candidates per prompt, scored. Stage 2: the other
    num_generations - first for the prompts `keep_for_second_stage` selects. Passes of new
    prompts continue until n_prompts groups are kept or max_sampling_rounds is reached; the
    shortfall is filled by completing skipped groups (those then cost their full price)."""
    cfg = sampler.cfg
    ts, n = cfg.rollout.two_stage, cfg.rollout.num_generations
    judge = ts.reward or sampler.rewards[0].name
    stats = SamplingStats(two_stage=True)
    kept: list[Group] = []
    skipped: list[Group] = []
    first_seconds = 0.0
    first_count = 0

    def stage(prompts: list[Prompt], k: int, pass_: int) -> tuple[list[Group], RewardReport]:
        groups, report = sampler.scored(prompts, step, pass_, k)
        stats.rewards = stats.rewards.merge(report)
        return groups, report

    while len(kept) < n_prompts and stats.rounds < cfg.algo.max_sampling_rounds:
        first, report = stage(take(n_prompts - len(kept)), ts.first_generations, 2 * stats.rounds)
        first_seconds += report.sandbox.get("seconds", 0.0)
        first_count += len(first) * ts.first_generations
        passes = [keep_for_second_stage(g.rewards[judge], ts.keep, ts.threshold) for g in first]
        go = [g for g, ok in zip(first, passes) if ok]
        skipped += [g for g, ok in zip(first, passes) if not ok]
        if go:
            rest, _ = stage([g.prompt for g in go], n - ts.first_generations, 2 * stats.rounds + 1)
            kept += [_extend(g, r) for g, r in zip(go, rest)]
        stats.rounds += 1
        stats.generated_groups += len(first)
    if len(kept) < n_prompts:  # not enough prompts passed the rule: complete skipped ones
        fill = skipped[: n_prompts - len(kept)]
        skipped = skipped[len(fill) :]
        rest = stage([g.prompt for g in fill], n - ts.first_generations, 2 * stats.rounds + 1)[0] if fill else []
        kept += [_extend(g, r) for g, r in zip(fill, rest)]
    stats.kept_informative = sum(1 for g in kept[:n_prompts] if informative(g))
    stats.prompts_skipped = len(skipped)
    stats.generations_saved = len(skipped) * (n - ts.first_generations)
    per_execution = first_seconds / first_count if first_count else 0.0
    stats.sandbox_seconds_saved = per_execution * stats.generations_saved
    return kept[:n_prompts], stats
