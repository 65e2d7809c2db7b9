"""A rollout program of your own (docs/environments.md, "Write your own rollout program"): an
answer without \\boxed{} gets one more try after a hint the program adds (left out of the loss).

    rollout: {program: retry_program:RetryUnboxed}
"""

from dataclasses import replace

from plait.programs import joined


HINT = "\nPut the final answer in \\boxed{}: "


class RetryUnboxed:
    def __init__(self, setup):  # plait.programs.ProgramSetup: the run's cfg, tokenizer, sandbox
        self.tokenizer = setup.tokenizer
        self.hint = self.tokenizer(HINT, add_special_tokens=False)["input_ids"]

    def run(self, sampler, prompts, params, n):
        rows = sampler.generate(prompts, params, n)  # n answers per prompt, as plait samples them
        retry = [
            (i, j)
            for i, row in enumerate(rows)
            for j, c in enumerate(row)
            if "\\boxed{" not in c.text and len(c.token_ids) + len(self.hint) < params.max_tokens
        ]
        tried = [prompts[i].token_ids + rows[i][j].token_ids + self.hint for i, j in retry]
        # each retry a random stream of its own (the engine seeds a row by its prompt's index)
        again = [replace(prompts[i], index=prompts[i].index * n + j, token_ids=t) for (i, j), t in zip(retry, tried)]
        room = params.max_tokens - len(self.hint) - max((len(rows[i][j].token_ids) for i, j in retry), default=0)
        seconds = sampler.generate(again, replace(params, max_tokens=room, seed=params.seed + 1), 1) if retry else []
        for (i, j), (second,) in zip(retry, seconds):
            rows[i][j] = joined([rows[i][j], self.hint, second], self.tokenizer)
        return rows

    def close(self):
        pass
