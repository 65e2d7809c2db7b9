"""Greedy evaluation: the share of held-out prompts a metric (a reward function) scores 1."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.rewards.runner import BoundReward, call_reward, reward_inputs
from plait.types import Group, Prompt, SamplingParams


@dataclass
class EvalResult:
    accuracy: float
    n: int
    samples: list[dict] = field(default_factory=list)
    # per environment (the prompts' `environment` column): label -> (summed score, scored prompts)
    by_environment: dict[str, tuple[float, int]] = field(default_factory=dict)


def evaluate(
    program,
    engine,
    prompts: list[Prompt],
    metric: BoundReward,
    max_tokens: int,
    stop: list[str] | None = None,
) -> EvalResult:
    """Greedy-decode every prompt once through the run's rollout program (plait/programs: its
    tools, its agent) and average `metric` over them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=list(stop or []))
    outs = program.run(engine, prompts, params, 1)
    groups = [Group(p, cs) for p, cs in zip(prompts, outs)]
    inputs = reward_inputs(groups)
    scores = call_reward(metric, inputs)
    texts = inputs.texts
    samples = [
        {"prompt": p.text, "answer": p.answer, "completion": t, "score": s} for p, t, s in zip(prompts, texts, scores)
    ]
    valid = [s for s in scores if s is not None]  # None: not applicable / the sandbox failed
    by_env: dict[str, tuple[float, int]] = {}
    for p, score in zip(prompts, scores):
        label = p.columns.get("environment")
        if label is not None and score is not None:
            total, n = by_env.get(str(label), (0.0, 0))
            by_env[str(label)] = (total + score, n + 1)
    return EvalResult(sum(valid) / max(1, len(valid)), len(valid), samples, by_env)
