"""Multi-turn rollouts with tools (the `tools` rollout program), through any rollout engine.

`ToolLoop.run` samples the first turn of every completion through the engine (HF, vLLM
colocated or servers, the async generation process) as a single answer would be, then
alternates tool turns and model turns until no completion calls a tool, `max_turns` is reached
or the token budget (`max_completion_length`, tool output included) is spent. A later model
turn is one more `generate` call whose prompt is the token ids so far, so nothing is ever
decoded and re-tokenized: the model's tokens stay as sampled, and each tool turn's text is
tokenized on its own and appended with `sampled_mask` 0 (no loss, no log-prob ratio on it).

Each later turn samples from a stream of its own (the round's seed, the turn, the completion),
so a round is as reproducible as a single-turn one: a resumed run regenerates it exactly, as
long as the tools answer the same (see calls.py on the Python session).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from plait.programs.calls import HERMES_STOP, PYTHON_STOP, Call, ToolRunner, find_calls, tool_functions
from plait.programs.template import ChatTurns, chat_turns
from plait.types import Completion, Prompt, SamplingParams


TURN_SEED = 7_919  # a later turn's seed: the round's plus TURN_SEED x turn


@dataclass
class Conversation:
    """One completion being built, turn by turn."""

    prompt: Prompt
    stream: int  # its own random stream in later turns (unique within a generate call)
    budget: int  # tokens it may still take, tool output included
    history_text: str  # what the model was given: the prompt text and every piece since
    history: list[dict] | None  # the chat messages rendered so far (None: no chat template)
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    per_token_versions: bool = False
    pieces: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # after the prompt, for rewards and samples
    turn_text: str = ""  # the model turn in progress (a turn resumed after a stop spans calls)
    model_turns: list[str] = field(default_factory=list)  # its finished turns, what rewards read
    cells: list[str] = field(default_factory=list)  # the Python session's history
    calls: list[Call] = field(default_factory=list)  # to run before the next model turn
    env: object = None  # its trl_env Session (plait/programs/trl_env.py), if its row has an environment
    turns: ChatTurns | None = None  # its row's own tool schemas (a trl_env row), else the engine's
    generate_calls: int = 0
    finish: str | None = None  # set when done
    env_reward: float | None = None
    truncated: bool = False
    stats: dict[str, float] = field(
        default_factory=lambda: {"calls": 0.0, "errors": 0.0, "timeouts": 0.0, "turns": 0.0, "seconds": 0.0}
    )

    def append(self, ids: list[int], sampled: bool, logprobs=None, versions=None) -> None:
        version = self.versions[-1] if self.versions else None
        self.tokens += ids
        self.sampled += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [version] * len(ids)

    def as_prompt(self) -> Prompt:
        """The conversation so far as a prompt to continue from (its own tokens, never re-tokenized)."""
        p = self.prompt
        return replace(p, index=self.stream, text=p.text + "".join(self.pieces), token_ids=p.token_ids + self.tokens)

    def completion(self) -> Completion:
        versions = [v for v in self.versions if v is not None]
        messages = self.messages + ([{"role": "assistant", "content": self.turn_text}] if self.turn_text else [])
        return Completion(
            prompt_index=self.prompt.index,
            token_ids=self.tokens,
            text="".join(self.pieces) + self.turn_text,
            logprobs=self.logprobs,
            truncated=self.truncated,
            finish_reason=self.finish or "length",
            weight_version=min(versions, default=None),
            token_versions=[v if v is not None else 0 for v in self.versions] if self.per_token_versions else None,
            sampled_mask=self.sampled,
            messages=messages,
            info={f"tools/{k}": v for k, v in self.stats.items()}
            | {"tools/turns": float(sum(m["role"] == "assistant" for m in messages))},
            env_reward=self.env_reward,
            env_error=None if self.env is None else self.env.error,
            model_text="\n".join(t for t in [*self.model_turns, self.turn_text] if t),  # a tool turn came between each
        )


class ToolLoop:
    """The multi-turn tool loop: the model's turns stop at tool calls, `runner` answers them."""

    def __init__(self, tokenizer, tools_cfg, runner: ToolRunner, turns: ChatTurns | None, workers: int = 2, envs=None):
        self.envs = envs  # trl_env entries (TrlEnvironments): a fresh environment per rollout
        self.tokenizer = tokenizer
        self.cfg = tools_cfg
        self.runner = runner
        self.turns = turns  # None: prompts are plain text, tool output goes in as cfg.plain_output
        self.workers = max(1, workers)
        self.stops = [PYTHON_STOP if tools_cfg.format == "python" else HERMES_STOP]

    @classmethod
    def from_setup(cls, setup) -> ToolLoop:
        """The run's tool loop (plait/programs/__init__.py: ProgramSetup): its tools, the sandbox
        they run in, its chat template's turns and its trl_env/OpenEnv environments."""
        cfg = setup.cfg
        runner = ToolRunner(cfg.rollout.tools, setup.sandbox, tool_functions(cfg.rollout.tools))
        turns = chat_turns(cfg, setup.tokenizer)
        return cls(setup.tokenizer, cfg.rollout.tools, runner, turns, workers=cfg.sandbox.workers, envs=setup.envs)

    def close(self) -> None:
        pass

    def run(self, sampler, prompts: list[Prompt], params: SamplingParams, n: int) -> list[list[Completion]]:
        user_stops = list(params.stop)
        params = replace(params, stop=[*user_stops, *(s for s in self.stops if s not in user_stops)])
        convs = [
            Conversation(
                p,
                stream=p.index * n + j,
                budget=params.max_tokens,
                history_text=p.text,
                history=list(p.messages) if self.turns is not None and p.messages is not None else None,
            )
            for p in prompts
            for j in range(n)
        ]
        if self.envs is not None:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="plait-envs") as pool:
                for conv, env in zip(convs, pool.map(self.envs.open, [c.prompt for c in convs])):
                    conv.env = env
                    if env is not None and self.turns is not None:
                        conv.turns = self.turns.with_tools(self.envs.schemas_for(conv.prompt))
        firsts = sampler.generate(prompts, params, n)
        for conv, c in zip(convs, [c for row in firsts for c in row]):
            self._model_turn(conv, c, user_stops)
        turn = 1
        while True:
            calling = [c for c in convs if c.calls]
            if calling:
                with ThreadPoolExecutor(self.workers, thread_name_prefix="plait-tools") as pool:
                    list(pool.map(self._tool_turn, calling))
            going = [c for c in convs if c.finish is None]
            if not going:
                break
            later = replace(params, max_tokens=max(c.budget for c in going), seed=params.seed + TURN_SEED * turn)
            outs = sampler.generate([c.as_prompt() for c in going], later, 1)
            for conv, row in zip(going, outs):
                self._model_turn(conv, row[0], user_stops)
            turn += 1
        scored = [c for c in convs if c.env is not None]
        if scored:  # each environment scores its finished rollout (get_reward)
            with ThreadPoolExecutor(self.workers, thread_name_prefix="plait-envs") as pool:
                for conv, reward in zip(scored, pool.map(lambda c: c.env.reward(), scored)):
                    conv.env_reward = reward
        return [[c.completion() for c in convs[i * n : (i + 1) * n]] for i in range(len(prompts))]

    def _model_turn(self, conv: Conversation, c: Completion, user_stops: list[str]) -> None:
        """Take a model turn's tokens (cut to the budget) and decide what comes next: a tool turn
        (its calls queued), the same turn resumed (a tool stop string without a whole call), or
        the end."""
        ids = c.token_ids[: conv.budget]
        versions = c.token_versions[: len(ids)] if c.token_versions else [c.weight_version] * len(ids)
        conv.per_token_versions |= bool(c.token_versions)
        conv.append(ids, True, c.logprobs[: len(ids)], versions)
        conv.budget -= len(ids)
        conv.generate_calls += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        conv.turn_text += text
        if conv.budget <= 0 or c.finish_reason == "length":
            conv.finish, conv.truncated = "length", True
            return
        calls = find_calls(conv.turn_text, self.cfg.format)
        room = conv.generate_calls < self.cfg.max_turns
        if calls and c.finish_reason == "eos" and self.turns is None:
            conv.finish = "eos"  # plain text: the end of the text is the end, whatever it ends with
        elif calls and room:
            conv.calls = calls
        elif calls:
            conv.finish = "max_turns"  # its last call goes unanswered
        elif c.finish_reason == "stop" and room and not any(s in conv.turn_text for s in user_stops):
            pass  # a tool stop string without a whole call (a fence of another language): go on
        else:
            conv.finish = c.finish_reason

    def _tool_turn(self, conv: Conversation) -> None:
        """Run the conversation's calls and append their output as a tool turn (masked)."""
        results = [self.runner.run(call, conv.cells, conv.env) for call in conv.calls]
        conv.stats["calls"] += len(results)
        conv.stats["errors"] += sum(r.status == "error" for r in results)
        conv.stats["timeouts"] += sum(r.status == "timeout" for r in results)
        conv.stats["seconds"] += sum(r.seconds for r in results)
        assistant = {"role": "assistant", "content": conv.turn_text}
        if self.cfg.format == "hermes":
            said = [
                {"role": self.cfg.role, "name": call.name, "content": r.output} for call, r in zip(conv.calls, results)
            ]
            shown = {**assistant, "tool_calls": [_call_message(call) for call in conv.calls]}
        else:
            said = [{"role": self.cfg.role, "content": results[0].output}]
            shown = assistant
        if self.turns is not None:
            after = (conv.turns or self.turns).after_turn(conv.history, conv.history_text, said)
            conv.history += [assistant, *said]
        else:
            after = self.cfg.plain_output.format(output=results[0].output)
        conv.messages += [shown, *said]
        conv.pieces += [conv.turn_text, after]
        conv.model_turns.append(conv.turn_text)
        conv.history_text += conv.turn_text + after
        conv.turn_text, conv.calls = "", []
        ids = self.tokenizer(unsampled(self.tokenizer, conv.tokens, conv.sampled, after), add_special_tokens=False)[
            "input_ids"
        ]
        conv.append(ids[: conv.budget], sampled=False)
        if len(ids) >= conv.budget:
            conv.finish, conv.truncated = "length", True
        conv.budget -= min(len(ids), conv.budget)


def model_words(pieces: list[tuple[str, bool]]) -> str:
    """What the model wrote among `pieces` (each: text, whether the model wrote it), a line break
    standing for each stretch of someone else's text between two of its own (a tool's output, an
    agent's turn), so two replies never run together into one word or number. Its pieces with
    nothing between them (a reply continued where it stopped) join as sampled."""
    out: list[str] = []
    between = False
    for text, own in pieces:
        if not own:
            between = between or bool(text)
            continue
        if between and out and text:
            out.append("\n")
        if text:
            out.append(text)
            between = False
    return "".join(out)


def unsampled(tokenizer, tokens: list[int], sampled: list[int], after: str) -> str:
    """`after` less the end-of-turn token the model already sampled (it ended its turn with EOS,
    which the template's text after the turn starts with)."""
    if tokens and sampled[-1]:
        last = tokenizer.convert_ids_to_tokens(tokens[-1])
        if last in tokenizer.all_special_tokens and after.startswith(last):
            return after[len(last) :]
    return after


def _call_message(call: Call) -> dict:
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
