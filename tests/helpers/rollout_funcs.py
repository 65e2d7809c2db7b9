"""Rollout functions (`rollout.rollout_func`, plait/programs/rollout_func.py) for tests."""

from __future__ import annotations


FEEDBACK = " Check that once more."


def two_turns(prompts, ctx):
    """The model answers, the loop adds a fixed line (env_mask 0), the model answers again."""
    n, budget = ctx.num_generations, ctx.max_tokens // 3
    firsts = ctx.generate(ctx.prompt_ids, max_tokens=budget, n=n)
    line = ctx.tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    again = [ctx.prompt_ids[i] + s.token_ids + line for i, row in enumerate(firsts) for s in row]
    seconds = [row[0] for row in ctx.generate(again, max_tokens=budget)]
    out = {"completion_ids": [], "logprobs": [], "env_mask": [], "turns": []}
    for first, second in zip([s for row in firsts for s in row], seconds):
        out["completion_ids"].append(first.token_ids + line + second.token_ids)
        out["logprobs"].append(first.logprobs + [0.0] * len(line) + second.logprobs)
        out["env_mask"].append([1] * len(first.token_ids) + [0] * len(line) + [1] * len(second.token_ids))
        out["turns"].append(2)
    return out


def turns_reward(completions, turns, **_):
    """The rollout function's own `turns` field, as a reward."""
    return [float(t) / 2 for t in turns]


def short_of_one(prompts, ctx):
    """Returns one completion too few."""
    out = two_turns(prompts, ctx)
    return {k: v[:-1] for k, v in out.items()}


def no_logprobs(prompts, ctx):
    out = two_turns(prompts, ctx)
    del out["logprobs"]
    return out


def other_prompt(prompts, ctx):
    out = two_turns(prompts, ctx)
    out["prompt_ids"] = [[1] + ctx.prompt_ids[k // ctx.num_generations] for k in range(len(out["turns"]))]
    return out


def empty_prompt(prompts, ctx):
    out = two_turns(prompts, ctx)
    out["prompt_ids"] = [[] for _ in out["turns"]]
    return out
