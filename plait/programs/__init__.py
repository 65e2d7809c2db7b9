"""Rollout programs: what one rollout is, and the environments rollouts run in.

A rollout program turns a round's prompts into trajectories (`Completion`s: tokens, loss mask,
the engine's log-probs, the weight version of each token, a reward or reward inputs, numbers for
the metrics), sampling through the engine it is handed. The engine only samples and holds
weights; no program wraps it. A run has one program, chosen once from its config by
`program_kind` and built by the PROGRAMS registry (or `rollout.program: module:factory`, your own):

  single        one sampled answer per rollout (the default)           this file
  tools         the multi-turn tool loop; trl_env and OpenEnv           tool_loop.py, tools.py, calls.py,
                environments give it their tools and rewards            template.py, trl_env.py, openenv.py
  rollout_func  your own rollout loop (TRL's rollout_func)              rollout_func.py
  agent         any agent program, through an OpenAI-compatible         agent.py, endpoint.py
                endpoint that records its calls

environments.py  the `environments:` entries whose rows are prompts (reasoning-gym: reasoning_gym.py)

A program samples a whole round at once (every prompt's rollouts, turn by turn) so the engine
decodes all of them together; write your own: docs/environments.md, "Write your own rollout program".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from plait.types import Completion, Prompt, SamplingParams


class Sampler(Protocol):
    """What a program samples through: the run's engine (plait/rollout/base.py), at this round's
    weights and with the run's sampling settings in `params`."""

    pad_id: int

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """`n` completions of each prompt's `token_ids` (never re-tokenized), in prompt order, with
        the engine's log-probs; deterministic for a given params.seed."""


class RolloutProgram(Protocol):
    def run(self, sampler: Sampler, prompts: list[Prompt], params: SamplingParams, n: int) -> list[list[Completion]]:
        """`n` rollouts of each prompt, in prompt order (row i holds prompt i's), each a Completion
        whose `token_ids` follow the prompt's tokens (or its own `prompt_ids`). Deterministic for a
        given params.seed: a resumed run samples the same rounds again."""

    def close(self) -> None:
        """Free what the program holds (an endpoint, a pool); the engine is not its own."""


@dataclass
class ProgramSetup:
    """What a program is built from: the run's config and tokenizer, the sandbox model-written
    code runs in (None when nothing the model writes runs), and the run's trl_env/OpenEnv
    environments (plait/programs/trl_env.py: TrlEnvironments; None without them)."""

    cfg: Any
    tokenizer: Any
    sandbox: Any = None
    envs: Any = None


class Single:
    """One sampled answer per rollout."""

    def run(self, sampler: Sampler, prompts: list[Prompt], params: SamplingParams, n: int) -> list[list[Completion]]:
        return sampler.generate(prompts, params, n)

    def close(self) -> None:
        pass


def joined(parts: list[Completion | list[int]], tokenizer) -> Completion:
    """One trajectory from what a program sampled (Completions, trained on) and the token ids it
    added between them (a hint, a tool's output: kept in the sequence, left out of the loss, their
    log-probs 0). Rewards read the sampled parts alone, a line break where something was added
    between two; the last sampled part says how it ended."""
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    versions: list[int | None] = []
    pieces: list[tuple[str, bool]] = []
    for part in parts:
        if isinstance(part, Completion):
            ids += part.token_ids
            logprobs += part.logprobs
            mask += [1] * len(part.token_ids)
            versions += part.token_versions or [part.weight_version] * len(part.token_ids)
            pieces.append((part.text, True))
        else:
            ids += part
            logprobs += [0.0] * len(part)
            mask += [0] * len(part)
            versions += [versions[-1] if versions else None] * len(part)  # added at the version before it
            pieces.append((tokenizer.decode(part, skip_special_tokens=True), False))
    sampled = [p for p in parts if isinstance(p, Completion)]
    known = [v for v in versions if v is not None]
    from plait.programs.tool_loop import model_words

    return Completion(
        prompt_index=sampled[0].prompt_index,
        token_ids=ids,
        text=tokenizer.decode(ids, skip_special_tokens=True),
        logprobs=logprobs,
        truncated=sampled[-1].truncated,
        finish_reason=sampled[-1].finish_reason,
        weight_version=min(known, default=None),
        token_versions=[v or 0 for v in versions] if any(p.token_versions for p in sampled) else None,
        sampled_mask=mask,
        model_text=model_words(pieces),
    )


def _tools(setup: ProgramSetup) -> RolloutProgram:
    from plait.programs.tool_loop import ToolLoop

    return ToolLoop.from_setup(setup)


def _rollout_func(setup: ProgramSetup) -> RolloutProgram:
    from plait.programs.rollout_func import RolloutFuncProgram

    return RolloutFuncProgram.from_setup(setup)


def _agent(setup: ProgramSetup) -> RolloutProgram:
    from plait.programs.agent import AgentProgram

    return AgentProgram.from_setup(setup)


# kind -> factory(setup); each kind's module is imported only by runs that use it
PROGRAMS: dict[str, Callable[[ProgramSetup], RolloutProgram]] = {
    "single": lambda setup: Single(),
    "tools": _tools,
    "rollout_func": _rollout_func,
    "agent": _agent,
}


def program_kind(cfg) -> str:
    """The run's kind of rollout program: `rollout.program` when it names one, else the section
    the config sets (the config check refuses two of them at once)."""
    r = cfg.rollout
    if r.program is not None:
        return r.program
    if r.agent is not None:
        return "agent"
    if r.rollout_func is not None:
        return "rollout_func"
    if r.tools is not None:
        return "tools"
    return "single"


def make_program(setup: ProgramSetup) -> RolloutProgram:
    """The run's rollout program: a registry entry, or `module:factory` (your own, called with the
    ProgramSetup)."""
    kind = program_kind(setup.cfg)
    if kind in PROGRAMS:
        return PROGRAMS[kind](setup)
    from plait.programs.calls import resolve_function

    return resolve_function(kind, "rollout program")(setup)
