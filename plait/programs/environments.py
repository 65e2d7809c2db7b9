"""Environments: task generators that bring their own verifier (config section `environments`).

Each entry of the section is one environment; together they are a weighted mixture of prompts.
Every row an environment makes carries two columns beside its prompt and answer:

    environment   the entry's label (its `name`, else its dataset), for per-environment metrics
    env_source    where the problem came from, enough to rebuild it where it is scored

The built-in reward `environment` scores a completion with its environment's own verifier.
An environment that fails while scoring (raises) is an infrastructure error, not a wrong
answer: the completion's reward is None, so it is left out of the advantages' statistics and
trains on nothing, and the round counts it under `env/<label>/errors`. (A verifier that cannot
read an answer but scores its own reference answer is the answer's fault: reasoning_gym.py.)
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from types import ModuleType

from plait.programs import openenv, reasoning_gym, trl_env


# One entry per `type` of the section (its options: plait/config/schema.py ENVIRONMENT_MODELS).
# A type whose model has ACTS_ON_ROWS acts on the data's rows through tools: its module has
# tool_kind(spec, label, timeout_s) -> trl_env.EnvKind and problems(spec, label). The others
# replace the rows with problems of their own: rows, system_prompt, worked_examples,
# problems(spec, label, seed, size, evaluating), extract_answer and score_answer.
KINDS: dict[str, ModuleType] = {"reasoning_gym": reasoning_gym, "trl_env": trl_env, "openenv": openenv}
# a row's own system prompt (an environment's), used when data.system_prompt is unset
SYSTEM_COLUMN = "_system"
# a row's worked examples (an environment's own), as turns put before its prompt
SHOTS_COLUMN = "_shots"

log = logging.getLogger(__name__)


def tool_environments(cfg, standalone_schemas: list[dict]) -> trl_env.TrlEnvironments | None:
    """The run's entries that act on the data's rows, as the tool loop runs them (None: none)."""
    specs = [e for e in cfg.environments if e.ACTS_ON_ROWS]
    if not specs:
        return None
    timeout_s = cfg.rollout.tools.timeout_s
    kinds = [KINDS[s.type].tool_kind(s, s.label, timeout_s) for s in specs]
    return trl_env.TrlEnvironments(kinds, timeout_s, standalone_schemas)


def train_sizes(specs) -> list[int]:
    """Training problems per environment: each one's `size`, or, when weights are given, the
    weights' shares of the sizes' sum (an unweighted entry weighs 1)."""
    sizes = [s.size for s in specs]
    if all(s.weight is None for s in specs):
        return sizes
    weights = [1.0 if s.weight is None else s.weight for s in specs]
    return [max(1, round(sum(sizes) * w / sum(weights))) for w in weights]


def environment_rows(specs, split: str, seed: int, system_prompt: str | None) -> list[dict]:
    """The mixture's rows for 'train' or 'eval', environment by environment (the prompt order
    shuffles them). Each environment is seeded by its own `seed`, else the run's."""
    out = []
    for spec, size in zip(specs, train_sizes(specs)):
        kind = KINDS[spec.type]
        own_seed = seed if spec.seed is None else spec.seed
        rows = kind.rows(spec, spec.label, split, own_seed, size)
        own = kind.system_prompt(spec) if system_prompt is None else None
        extra = {SYSTEM_COLUMN: own, SHOTS_COLUMN: kind.worked_examples(spec, own_seed, size)}
        extra = {k: v for k, v in extra.items() if v}  # a column only where the environment has one
        for row in rows:
            row.update(extra)
        out += rows
    return out


def describe_shots(specs) -> list[str]:
    """The run header's lines on the environments' own worked examples."""
    lines = []
    for s in specs:
        if s.ACTS_ON_ROWS or not s.examples:  # (their rows' examples are the data's)
            continue
        own = isinstance(s.examples, list)
        n, whose = (len(s.examples), "the config's own") if own else (s.examples, "the environment's examples")
        lines.append(f"few-shot: {n} worked example(s) before every '{s.label}' prompt ({whose})")
    return lines


def environment_problems(specs, seed: int, evaluating: bool = False) -> list[str]:
    """`plait check`: each environment builds a row and scores its own answer, offline (and,
    when the run evaluates, has held-out problems)."""
    out = []
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        out.append(f"environments: labels must differ, got {labels}; give the entries different `name`s")
    if len({s.ACTS_ON_ROWS for s in specs}) > 1:
        out.append(
            "environments: trl_env and openenv entries act on the data's rows and reasoning_gym entries replace them "
            "with their own problems; one run takes one kind (train them in two runs)"
        )
    own_problems = [s for s in specs if not s.ACTS_ON_ROWS]  # (the others are checked with the tools: checks.py)
    for spec, size in zip(own_problems, train_sizes(own_problems)):
        own = seed if spec.seed is None else spec.seed
        out += KINDS[spec.type].problems(spec, spec.label, own, size, evaluating)
    return out


class EnvironmentFailed(RuntimeError):
    """An environment's verifier failed on too many of a round's completions: the run stops."""


def environment(
    completions: list[str],
    env_source: list[dict | None] | None = None,
    unformatted_credit: float = 0.0,
    env_reward: list[float | None] | None = None,
    env_error: list[str | None] | None = None,
    errors: dict[str, str] | None = None,
    **columns,
) -> list[float | None]:
    """Each completion scored by the verifier of the environment its prompt came from (a
    trl_env rollout: by what its environment's get_reward returned); None where that failed (an
    infrastructure error, logged) or the row has no environment.

    unformatted_credit: the share of the score an answer earns when it is not where the
    environment asked for it (its last number, else its last line, is given to the verifier),
    so a model that does not box its answers yet gets a signal; the eval metric, bound without
    kwargs, stays strict. errors: filled with each failing environment's last error (the reward
    runner hands in one per call and keeps it in its report, for the run's stop message)."""
    out: list[float | None] = []
    n = len(completions)
    errors = {} if errors is None else errors
    labels = columns.get("environment") or [None] * n
    rewarded = zip(env_reward or [None] * n, env_error or [None] * n)
    failures: Counter[str] = Counter()  # one warning per environment per call, not one per completion
    for completion, source, name, (reward, error) in zip(completions, env_source or [None] * n, labels, rewarded):
        if error is not None and name is not None:  # (an agent's rollout has no label: its engine warns, naming it)
            errors[str(name)] = error
            failures[str(name)] += 1
        if not source:
            out.append(reward)
            continue
        kind = KINDS[source["type"]]  # built-in rewards get completions as text
        answer = kind.extract_answer(completion, source["answer_format"])
        try:
            if answer is not None:
                out.append(kind.score_answer(source, answer))
            elif unformatted_credit:
                out.append(unformatted_credit * kind.score_answer(source, last_statement(completion)))
            else:
                out.append(0.0)
        except Exception as err:
            key = str(name or source.get("dataset"))
            errors[key] = f"{type(err).__name__}: {err}"
            failures[key] += 1
            out.append(None)
    for name, count in failures.items():
        log.warning(
            "environment %s failed on %d of %d completions (left unscored); the last: %s",
            name,
            count,
            n,
            errors[name],
        )
    return out


def resume_advice(saved: int) -> str:
    """What resume=auto does for a run stopped after a failure, its last checkpoint at round
    `saved` (0: none was written)."""
    if saved:
        return f"then resume=auto continues from the last checkpoint (round {saved})"
    return "no checkpoint was written before it stopped, so resume=auto would start the run over from round 1"


def round_errors(groups) -> dict[str, str]:
    """The last error of each environment (by its label) and of the agent ("agent") among a
    round's rollouts, for the stop message: what their completions carry (`env_error`)."""
    out = {}
    for g in groups:
        for c in g.completions:
            if c.env_error is not None:
                agent = "agent/errors" in (c.info or {})
                out["agent" if agent else str(g.prompt.columns.get("environment"))] = c.env_error
    return out


def error_share_problem(
    specs, metrics: dict[str, float], round_: int, saved: int = 0, errors: dict[str, str] | None = None
) -> str | None:
    """Why the run must stop: an environment whose verifier failed on more than its
    `max_error_share` of the round's completions (None: none did). `saved`: the round of the
    run's last checkpoint (0: none), for the resume advice; `errors`: the round's last error per
    environment (round_errors, and the reward runner's report), quoted."""
    errors = errors or {}
    for spec in specs:
        name = spec.label
        failed, n = metrics.get(f"env/{name}/errors", 0.0), metrics.get(f"env/{name}/completions", 0.0)
        if n and failed / n > spec.max_error_share:
            cause = errors.get(name, "see the warnings above")
            return (
                f"environment '{name}' failed to score {failed:.0f} of its {n:.0f} completions in round {round_} "
                f"(more than its max_error_share {spec.max_error_share:g}); its last error: {cause}. Those were "
                f"not trained on; fix the environment; {resume_advice(saved)}"
            )
    return None


def agent_error_problem(
    agent, metrics: dict[str, float], round_: int, saved: int = 0, errors: dict[str, str] | None = None
) -> str | None:
    """Why the run must stop: more than rollout.agent.max_error_share of the round's agents
    failed (None: not so, or no agent). `saved` and `errors` as for error_share_problem."""
    if agent is None:
        return None
    failed, n = metrics.get("agent/errors", 0.0), metrics.get("agent/rollouts", 0.0)
    if n and failed / n > agent.max_error_share:
        cause = (errors or {}).get("agent", "see the warnings above")
        return (
            f"{failed:.0f} of the {n:.0f} agent rollouts of round {round_} failed (more than rollout.agent."
            f"max_error_share {agent.max_error_share:g}); the last: {cause}. Those were not trained on; fix the "
            f"agent {agent.function}; {resume_advice(saved)}"
        )
    return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_statement(text: str) -> str:
    """What a completion ends on: its last number, else its last non-empty line."""
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].rstrip(".") if lines else ""
