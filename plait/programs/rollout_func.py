"""Your own rollout loop (`rollout.rollout_func: module:function`), TRL's `rollout_func` in plait's terms.

The function gets the round's prompts and a context, and returns what was sampled:

    def my_rollout(prompts: list, ctx) -> dict:
        # prompts: each prompt as the dataset gave it (text, or chat messages), one entry per prompt
        # ctx.prompt_ids[i]: prompt i's tokens, as plait rendered it (the training sequence starts with them)
        # ctx.columns[i]: prompt i's other dataset columns; ctx.num_generations, ctx.max_tokens, ctx.tokenizer
        # ctx.generate(token_ids, max_tokens=None, n=1) -> [[Sample(token_ids, logprobs, finish_reason, text)]]
        ...
        return {
            "completion_ids": [...],  # prompts x num_generations lists of token ids, completion j of prompt i at i*n+j
            "logprobs": [...],        # the sampling log-prob of each of those tokens
            "env_mask": [...],        # optional: 1 where the model sampled the token, 0 where your loop added it
            "prompt_ids": [...],      # optional: the tokens each completion continues (default ctx.prompt_ids[i])
            "truncated": [...],       # optional: True where the completion was cut (default: it reached max_tokens)
            "anything_else": [...],   # one value per completion: a column the reward functions get by that name
        }

Every token is trained on exactly as returned (never re-tokenized from text); tokens with
env_mask 0 are left out of the loss as tool output is, and out of the text rewards read (the
model's tokens decoded, a line break where the loop's own came between them; the whole decoded
completion is their `transcript` column). The log-probs are what the trainer's
mismatch correction compares with its own: return those `ctx.generate` gave (plait's engine,
the weights of this round); tokens sampled elsewhere carry whatever log-probs you give them.
A malformed return stops the round with a message that names the key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any, Callable

from plait.programs.calls import resolve_function
from plait.programs.tool_loop import TURN_SEED, model_words  # the k-th generate call: the round's seed + TURN_SEED x k
from plait.types import Completion, Prompt, SamplingParams


RESERVED = ("completion_ids", "logprobs", "env_mask", "prompt_ids", "truncated")


class RolloutFuncError(ValueError):
    """The rollout function returned something plait can't train on."""


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


class RolloutContext:
    """What a rollout function may use: the prompts' tokens and columns, and plait's engine."""

    def __init__(self, engine, tokenizer, prompts: list[Prompt], params: SamplingParams, n: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt_ids = [list(p.token_ids) for p in prompts]
        self.columns = [dict(p.columns) for p in prompts]
        self.num_generations = n
        self.max_tokens = params.max_tokens
        self.params = params
        self.calls = 0
        self.versions: list[int] = []

    def generate(self, token_ids: list[list[int]], max_tokens: int | None = None, n: int = 1) -> list[list[Sample]]:
        """Sample `n` continuations of each token list with the round's weights and sampling
        settings (`max_tokens` defaults to the round's); log-probs are the engine's own."""
        prompts = [
            Prompt(index=i, text=self.tokenizer.decode(ids), token_ids=list(ids)) for i, ids in enumerate(token_ids)
        ]
        params = replace(
            self.params, max_tokens=max_tokens or self.max_tokens, seed=self.params.seed + TURN_SEED * self.calls
        )
        self.calls += 1
        out = self.engine.generate(prompts, params, n)
        self.versions += [c.weight_version for row in out for c in row if c.weight_version is not None]
        return [[Sample(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in row] for row in out]


class RolloutFuncProgram:
    """The `rollout_func` rollout program: the user's function samples the round."""

    def __init__(self, tokenizer, fn: Callable, name: str):
        self.tokenizer, self.fn, self.name = tokenizer, fn, name

    @classmethod
    def from_setup(cls, setup) -> RolloutFuncProgram:
        spec = setup.cfg.rollout.rollout_func
        return cls(setup.tokenizer, resolve_function(spec, "rollout function"), spec)

    def close(self) -> None:
        pass

    def run(self, sampler, prompts: list[Prompt], params: SamplingParams, n: int) -> list[list[Completion]]:
        ctx = RolloutContext(sampler, self.tokenizer, prompts, params, n)
        sources = [p.text if p.source is None else p.source for p in prompts]
        out = self.fn(sources, ctx)
        completions = self._completions(out, prompts, ctx)
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _completions(self, out: Any, prompts: list[Prompt], ctx: RolloutContext) -> list[Completion]:
        where = f"rollout_func {self.name}"
        if not isinstance(out, dict):
            raise RolloutFuncError(
                f"{where} returned {type(out).__name__}; return a dict with completion_ids and logprobs"
            )
        missing = [k for k in ("completion_ids", "logprobs") if k not in out]
        if missing:
            raise RolloutFuncError(f"{where} returned no {', '.join(missing)}: return them, one list per completion")
        total = len(prompts) * ctx.num_generations
        for key, values in out.items():
            if not isinstance(values, (list, tuple)) or len(values) != total:
                got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise RolloutFuncError(
                    f"{where}: '{key}' has {got} entries; it needs one per completion, {len(prompts)} prompts x "
                    f"{ctx.num_generations} generations = {total} (completion j of prompt i at i*n+j)"
                )
        extra_keys = [k for k in out if k not in RESERVED]
        version = min(ctx.versions, default=None)
        completions = []
        for k in range(total):
            i = k // ctx.num_generations
            ids = [int(t) for t in out["completion_ids"][k]]
            logprobs = [float(x) for x in out["logprobs"][k]]
            mask = [int(m) for m in out["env_mask"][k]] if "env_mask" in out else [1] * len(ids)
            if len(logprobs) != len(ids) or len(mask) != len(ids):
                raise RolloutFuncError(
                    f"{where}: completion {k} has {len(ids)} tokens, {len(logprobs)} logprobs and {len(mask)} env_mask "
                    "entries; each token needs one of each"
                )
            own = [int(t) for t in out["prompt_ids"][k]] if "prompt_ids" in out else ctx.prompt_ids[i]
            if not own:
                raise RolloutFuncError(
                    f"{where}: completion {k}'s prompt_ids are empty; give the tokens it continues "
                    f"(ctx.prompt_ids[{i}] for the prompt plait rendered), or leave prompt_ids out"
                )
            if len(ids) > ctx.max_tokens:
                raise RolloutFuncError(
                    f"{where}: completion {k} has {len(ids)} tokens, more than rollout.max_completion_length "
                    f"({ctx.max_tokens}, ctx.max_tokens): cut it there and mark it truncated, or raise the limit"
                )
            truncated = bool(out["truncated"][k]) if "truncated" in out else len(ids) >= ctx.max_tokens
            completions.append(
                Completion(
                    prompt_index=prompts[i].index,
                    token_ids=ids,
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    logprobs=logprobs,
                    truncated=truncated,
                    finish_reason="length" if truncated else "eos",
                    weight_version=version,
                    sampled_mask=mask if "env_mask" in out else None,
                    columns={key: out[key][k] for key in extra_keys} or None,
                    prompt_ids=None if own == ctx.prompt_ids[i] else own,
                    model_text=self._model_text(ids, mask) if "env_mask" in out else None,
                )
            )
        return completions

    def _model_text(self, ids: list[int], mask: list[int]) -> str:
        """The tokens the model sampled (env_mask 1), decoded run by run: what rewards read."""
        runs = [(m, [t for t, _ in run]) for m, run in groupby(zip(ids, mask), key=lambda tm: tm[1])]
        return model_words([(self.tokenizer.decode(run, skip_special_tokens=True), bool(m)) for m, run in runs])
