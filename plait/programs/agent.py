"""Any agent program as the rollout (`rollout.agent`): plait serves an OpenAI-compatible endpoint
and records every token the agent's calls sample.

    def my_agent(task):                      # or `async def`
        client = task.client()               # openai.OpenAI(base_url=task.base_url, api_key=task.api_key)
        reply = client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.prompt}])
        ...                                   # any loop: tools, feedback, several calls
        return 1.0                            # optional: the rollout's reward (the `environment` reward reads it),
                                              # or {"reward": 1.0, "steps": 3}: other keys are reward columns

One agent call per rollout (prompts x num_generations per round), all running at once, each
with a base URL of its own (`.../rollouts/<key>/v1`, so every request is tagged with its
rollout) and the run's bearer token. The endpoint answers `POST /v1/chat/completions` and
`POST /v1/completions` (and `GET /v1/models`) with the tokens plait's engine sampled at this
round's weights, their log-probs, and `finish_reason` (`length` where the rollout's token budget,
rollout.max_completion_length, ran out).

**Linking by exact prefix.** A call continues an earlier one of its rollout when its input starts
with everything that call saw and returned: for chat, the same messages and the assistant reply
as plait returned it; for completions, the same prompt and text (or token ids). Then the training
sequence goes on from the tokens already recorded (never from the text re-tokenized: a sampled
token sequence often tokenizes differently once decoded), and only what the agent added (a tool
result, a user turn, the chat template's markup) is tokenized, with env_mask 0. A call that
continues nothing starts a new sample (a fork). The rollout trains on the sample its last call
belongs to (one sample per rollout keeps GRPO's groups whole); calls on samples it left are
counted (`agent/forked_calls`), not trained on.

**What rewards read.** The rollout's replies alone (the model's words, a line break where the
agent added a turn between two), never the agent's own turns: an agent that asks "give the answer
as \\boxed{N}" would otherwise earn every reply the format reward, and its N would be read as the
answer. A chat rollout keeps its whole conversation, every reply and every added turn under its
role: reward functions get it on conversational data (as TRL passes a multi-turn completion), and
samples.jsonl shows it. The text with the added turns is the rewards' `transcript` column.

**The budget.** rollout.max_completion_length counts every token of the training sequence after
the prompt, the agent's added turns too; a call it leaves nothing for gets an empty reply with
finish_reason `length`, said once a run and counted (agent/calls_out_of_budget).

**Determinism.** Calls are batched in lockstep: a batch is generated once every running agent
of the round is waiting for an answer (or has finished), so the batches, and with the seeds the
samples, are the same on every run as long as each agent is deterministic given its task and
makes one call at a time.

**Errors.** An agent that raises, runs past `rollout.agent.timeout_s` or makes no call is an
infrastructure error: its rollout is not scored (counted under agent/errors, a warning naming the
agent; the run stops past `rollout.agent.max_error_share`). A malformed request gets a 400 naming the field (the agent
sees it as the client's exception); a request without the token, a 401; after its agent returned,
a rollout's key is refused (409).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import textwrap
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from plait.programs.calls import find_calls
from plait.programs.endpoint import MODEL, AgentRequestError, Endpoint
from plait.programs.template import ChatTurns, TemplateMismatch
from plait.programs.tool_loop import model_words, unsampled
from plait.types import Completion, Prompt, SamplingParams


CALL_STREAMS = 4_096  # a call's random stream: its rollout x CALL_STREAMS + its number in the rollout

log = logging.getLogger(__name__)


@dataclass
class AgentTask:
    """What an agent gets: its row, and where to send its calls."""

    prompt: Any  # the row's prompt as the dataset gave it: text, or chat messages
    columns: dict  # the row's other columns
    base_url: str  # this rollout's own OpenAI base URL
    api_key: str  # the run's token (send it as the API key)
    model: str  # any name works; this is the one /v1/models lists
    index: int  # the rollout's number in its round
    max_tokens: int  # the rollout's token budget (rollout.max_completion_length), added turns included
    clients: list = field(default_factory=list, repr=False)  # those handed out, closed when the agent returns

    @property
    def messages(self) -> list[dict]:
        """The prompt as chat messages."""
        if isinstance(self.prompt, list):
            return [dict(m) for m in self.prompt]
        return [{"role": "user", "content": str(self.prompt)}]

    def client(self, **kwargs):
        """An `openai.OpenAI` client for this rollout. It does not retry by default: a call
        retried after an error plait already answered would sample (and be recorded) twice."""
        import openai

        return self._handed(openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs}))

    def async_client(self, **kwargs):
        """An `openai.AsyncOpenAI` client for this rollout (no retries, as `client`)."""
        import openai

        options = {"max_retries": 0, **kwargs}
        return self._handed(openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **options))

    def _handed(self, client):
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        """Close the sync clients handed out (an async one needs the loop it ran on: `aclose_clients`)."""
        for c in self.clients:
            if not inspect.iscoroutinefunction(c.close):
                c.close()

    async def aclose_clients(self) -> None:
        """Close every client handed out, on the agent's own event loop. Left open, an async client
        is closed by the garbage collector on whatever loop runs then (the endpoint's own), where
        its connections, bound to the agent's closed loop, fail: "Task exception was never
        retrieved ... Event loop is closed" in the run's log."""
        for c in self.clients:
            done = c.close()
            if inspect.isawaitable(done):
                await done


# ---------------------------------------------------------------- samples and their linking


@dataclass
class Sample:
    """One token sequence a rollout's linked calls built: the first call's prompt, then every
    token since (sampled, or added by the agent with sampled 0)."""

    kind: str  # "chat" | "text"
    prompt_ids: list[int]
    prompt_text: str
    tokens: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    # the text after the prompt, as the model was given it: (text, whether the model wrote it)
    pieces: list[tuple[str, bool]] = field(default_factory=list)
    truncated: bool = False
    finish: str = "length"
    calls: int = 0
    # chat: the conversation as the agent sees it (its last request and plait's reply), as the
    # template rendered it (assistant turns as sampled), and the text the model was given
    seen: list[dict] = field(default_factory=list)
    rendered: list[dict] = field(default_factory=list)
    history_text: str = ""
    turn_text: str = ""  # the last reply as sampled
    tools: list | None = None
    # chat: the conversation after the first prompt, every reply and every turn the agent added
    messages: list[dict] = field(default_factory=list)
    shown_text: str = ""  # text: the prompt and every reply as the agent got it (a stop string cut off)

    @property
    def text(self) -> str:
        return self.prompt_text + self.after_prompt

    @property
    def after_prompt(self) -> str:
        return "".join(text for text, _ in self.pieces)

    @property
    def model_text(self) -> str:
        """The replies alone (what rewards read), never the turns the agent added between them."""
        return model_words(self.pieces)

    def append(self, ids: list[int], sampled: bool, logprobs=None, version=None) -> None:
        self.tokens += ids
        self.sampled += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids)

    def take_reply(self, ids: list[int], logprobs: list[float], raw: str, version=None) -> None:
        """What the engine sampled for a call (decoded as `raw`): trained on, and the last reply."""
        self.append(ids, True, logprobs, version)
        self.pieces.append((raw, True))
        self.turn_text = raw


def _content(message: dict) -> str:
    """A message's text (content parts joined, None as empty)."""
    c = message.get("content")
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return "" if c is None else str(c)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _same_message(a: dict, b: dict) -> bool:
    """Does the agent's message `a` say what `b` said (content, and any tool calls by name and
    arguments; the fields clients add around them do not count)?"""
    if a.get("role") != b.get("role") or _content(a).strip() != _content(b).strip():
        return False
    calls = [
        [
            (c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
            for c in m.get("tool_calls") or []
        ]
        for m in (a, b)
    ]
    return calls[0] == calls[1]


def _plain(message: dict) -> dict:
    """A request message as the chat template gets it."""
    out = {k: v for k, v in message.items() if v is not None and k in ("role", "content", "name", "tool_call_id")}
    out["content"] = _content(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))},
            }
            for c in message["tool_calls"]
        ]
    return out


class Recording:
    """One rollout: its row, the samples its calls built, and how it ended."""

    def __init__(self, prompt: Prompt, index: int, key: str, budget: int):
        self.prompt, self.index, self.key, self.budget = prompt, index, key, budget
        self.samples: list[Sample] = []
        self.last: Sample | None = None
        self.calls = 0
        self.finished = False
        self.error: str | None = None
        self.reward: float | None = None
        self.columns: dict[str, Any] | None = None  # what the agent returned beside its reward
        self.out_of_budget = 0  # calls the budget left no token for
        self.started = time.monotonic()

    def link(
        self, kind: str, body: dict, tokenizer, turns: ChatTurns | None, max_prompt: int
    ) -> tuple[Sample, list[int]]:
        """The sample a request continues (a new one when it continues none) and its input tokens."""
        if kind == "chat":
            return self._link_chat(body, tokenizer, turns, max_prompt)
        return self._link_text(body, tokenizer, max_prompt)

    def _fork(self, kind: str, ids: list[int], text: str, max_prompt: int) -> Sample:
        if len(ids) > max_prompt:
            raise AgentRequestError(
                f"the prompt has {len(ids)} tokens, more than data.max_prompt_length={max_prompt} (a call that "
                "continues no earlier call of its rollout starts a new sample from its whole input): shorten it, or "
                "raise the limit"
            )
        sample = Sample(kind, list(ids), text)
        self.samples.append(sample)
        return sample

    def _link_chat(self, body, tokenizer, turns, max_prompt) -> tuple[Sample, list[int]]:
        if turns is None:
            raise AgentRequestError(
                "/v1/chat/completions needs a chat template: this run's data.chat_template is off or the tokenizer has "
                "none; use /v1/completions, or set data.chat_template"
            )
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise AgentRequestError("'messages' must be a non-empty list of {role, content} objects")
        tools = body.get("tools") or None
        turns = turns.with_tools(tools)
        for sample in reversed(self.samples):
            n = len(sample.seen)
            if sample.kind != "chat" or sample.tools != tools or len(messages) < n:
                continue
            if not all(_same_message(a, b) for a, b in zip(messages[:n], sample.seen)):
                continue
            added = [_plain(m) for m in messages[n:]]
            try:
                after = turns.after_turn(sample.rendered, sample.history_text, added)
            except TemplateMismatch:
                continue
            sample.rendered += [{"role": "assistant", "content": sample.turn_text}, *added]
            sample.history_text += sample.turn_text + after
            sample.messages += messages[n:]  # the reply before them is there already (_reply)
            self._add(sample, tokenizer, unsampled(tokenizer, sample.tokens, sample.sampled, after))
            return sample, sample.prompt_ids + sample.tokens
        plain = [_plain(m) for m in messages]
        text = turns.render(plain, True)
        sample = self._fork("chat", tokenizer(text, add_special_tokens=False)["input_ids"], text, max_prompt)
        sample.rendered, sample.history_text, sample.tools = plain, text, tools
        return sample, list(sample.prompt_ids)

    def _link_text(self, body, tokenizer, max_prompt) -> tuple[Sample, list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        given_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or given_ids) or not prompt:
            raise AgentRequestError(
                "'prompt' must be one non-empty string or one list of token ids (one prompt per call)"
            )
        for sample in reversed(self.samples):
            if sample.kind != "text":
                continue
            whole = sample.prompt_ids + sample.tokens
            if given_ids and len(prompt) >= len(whole) and prompt[: len(whole)] == whole:
                added = list(prompt[len(whole) :])
                text = tokenizer.decode(added)
                sample.shown_text += text
                self._add(sample, tokenizer, text, added)
                return sample, sample.prompt_ids + sample.tokens
            if not given_ids and prompt.startswith(sample.shown_text):
                added = prompt[len(sample.shown_text) :]
                sample.shown_text += added
                self._add(sample, tokenizer, added)
                return sample, sample.prompt_ids + sample.tokens
        if given_ids:
            sample = self._fork("text", list(prompt), tokenizer.decode(list(prompt)), max_prompt)
        else:
            sample = self._fork("text", tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt, max_prompt)
        sample.shown_text = sample.prompt_text
        return sample, list(sample.prompt_ids)

    def _add(self, sample: Sample, tokenizer, text: str, ids: list[int] | None = None) -> None:
        """What the agent added since the sample's last reply (not sampled: no loss), cut to the budget."""
        if ids is None:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        room = self.budget - len(sample.tokens)
        sample.pieces.append((text, False))
        sample.append(ids[: max(0, room)], sampled=False)
        if len(ids) >= room:
            sample.truncated, sample.finish = True, "length"


# ---------------------------------------------------------------- one round's calls


@dataclass
class Call:
    """A request waiting for its batch."""

    recording: Recording
    kind: str
    body: dict
    future: Future


class Round:
    """The recordings of one `generate` call and the requests they are waiting on."""

    def __init__(self, recordings: list[Recording], timeout_s: float):
        self.recordings = {r.key: r for r in recordings}
        self.order = recordings
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.pending: list[Call] = []

    def submit(self, key: str, kind: str, body: dict) -> Future:
        fut: Future = Future()
        with self.cond:
            rec = self.recordings.get(key)
            if rec is None:
                fut.set_exception(AgentRequestError("no rollout has this URL (is it from an earlier round?)", 404))
            elif rec.finished:
                fut.set_exception(
                    AgentRequestError(f"rollout {rec.index} has finished: its agent returned or timed out", 409)
                )
            else:
                self.pending.append(Call(rec, kind, body, fut))
                self.cond.notify_all()
        return fut

    def finish(self, rec: Recording, error: str | None = None, reward: float | None = None, columns=None) -> None:
        with self.cond:
            if rec.finished:
                return
            rec.finished, rec.error, rec.reward, rec.columns = True, error, reward, columns
            self._refuse_pending(rec, AgentRequestError(f"rollout {rec.index} has finished", 409))
            self.cond.notify_all()

    def next_batch(self) -> list[Call] | None:
        """The calls of every running agent, once each is waiting (None: every agent finished)."""
        with self.cond:
            while True:
                self._expire()
                running = [r for r in self.order if not r.finished]
                if not running:
                    return None
                waiting = {c.recording.key for c in self.pending}
                if self.pending and all(r.key in waiting for r in running):
                    batch = sorted(self.pending, key=lambda c: c.recording.index)  # stable: arrival order within one
                    self.pending = []
                    return batch
                self.cond.wait(timeout=0.5)

    def _expire(self) -> None:
        now = time.monotonic()
        for r in self.order:
            if not r.finished and now - r.started > self.timeout_s:
                r.finished, r.error = True, f"the agent ran past rollout.agent.timeout_s={self.timeout_s:g}"
                self._refuse_pending(r, AgentRequestError(r.error, 408))

    def _refuse_pending(self, rec: Recording, err: AgentRequestError) -> None:
        for call in [c for c in self.pending if c.recording is rec]:
            self.pending.remove(call)
            call.future.set_exception(err)


# ---------------------------------------------------------------- the program


class AgentProgram:
    """The `agent` rollout program: the user's agent runs once per rollout, its calls served."""

    def __init__(self, tokenizer, fn: Callable, name: str, timeout_s: float, max_prompt: int, turns, endpoint):
        self.tokenizer, self.fn, self.name = tokenizer, fn, name
        self.timeout_s, self.max_prompt = timeout_s, max_prompt
        self.turns = turns  # ChatTurns of the run's chat template (None: /v1/chat/completions is refused)
        self.endpoint = endpoint  # plait.programs.endpoint.Endpoint
        self.told_budget_spent = False  # the warning on a call the budget left nothing for: once per run

    @classmethod
    def from_setup(cls, setup) -> AgentProgram:
        """The run's agent, its chat calls rendered with the run's chat template, and its endpoint."""
        from plait.programs.calls import resolve_function

        cfg, tokenizer, a = setup.cfg, setup.tokenizer, setup.cfg.rollout.agent
        own = cfg.data.chat_template if isinstance(cfg.data.chat_template, str) else None
        turns = ChatTurns(tokenizer, own) if cfg.data.chat_template and (own or tokenizer.chat_template) else None
        fn = resolve_function(a.function, "agent function")
        return cls(tokenizer, fn, a.function, a.timeout_s, cfg.data.max_prompt_length, turns, Endpoint(a.host, a.port))

    def close(self) -> None:
        self.endpoint.close()

    def run(self, sampler, prompts: list[Prompt], params: SamplingParams, n: int) -> list[list[Completion]]:
        recs = [
            Recording(p, i * n + j, self.endpoint.new_key(), params.max_tokens)
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        round_ = Round(recs, self.timeout_s)
        self.endpoint.serve(round_)
        try:
            for rec in recs:  # daemons: an agent past its timeout can't be stopped, only left behind
                threading.Thread(target=self._run_agent, args=(round_, rec), name="plait-agent", daemon=True).start()
            while (batch := round_.next_batch()) is not None:
                self._answer(sampler, batch, params)
        finally:
            self.endpoint.serve(None)
        completions = [self._completion(r) for r in recs]
        self._warn_failures(recs)
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _warn_failures(self, recs: list[Recording]) -> None:
        """One line a round naming the agent, when some of its rollouts failed (they are not scored)."""
        failed = [r for r in recs if r.error is not None]
        if failed:
            last = failed[-1]
            log.warning(
                "agent %s failed on %d of %d rollouts (not scored); the last, rollout %d: %s",
                self.name,
                len(failed),
                len(recs),
                last.index,
                last.error,
            )

    def _run_agent(self, round_: Round, rec: Recording) -> None:
        task = AgentTask(
            rec.prompt.text if rec.prompt.source is None else rec.prompt.source,
            dict(rec.prompt.columns),
            self.endpoint.base_url(rec.key),
            self.endpoint.token,
            MODEL,
            rec.index,
            rec.budget,
        )
        try:
            reward, columns = _returned(_call_agent(self.fn, task))
        except Exception as err:  # noqa: BLE001 - the agent's failure is this rollout's infrastructure error
            round_.finish(rec, error=f"agent {self.name} raised {type(err).__name__}: {err}")
            return
        if rec.calls == 0:
            round_.finish(rec, error=f"agent {self.name} made no call to its endpoint (task.base_url)")
        else:
            round_.finish(rec, reward=reward, columns=columns)

    def _answer(self, sampler, batch: list[Call], params: SamplingParams) -> None:
        """Check each call, link it to its sample, generate them (one engine call per stop list), reply."""
        by_stop: dict[tuple, list] = {}
        for call in batch:
            try:
                asked, stops = _options(call.body)
                sample, ids = call.recording.link(call.kind, call.body, self.tokenizer, self.turns, self.max_prompt)
            except AgentRequestError as err:
                call.future.set_exception(err)
                continue
            except Exception as err:  # noqa: BLE001 - a request plait can't read is the agent's 400
                call.future.set_exception(AgentRequestError(f"{type(err).__name__}: {err}"))
                continue
            by_stop.setdefault(stops, []).append((call, sample, ids, asked))
        for stops, items in by_stop.items():
            self._generate(sampler, items, params, list(stops))

    def _generate(self, sampler, items, params: SamplingParams, stops: list[str]) -> None:
        going = []
        for call, sample, ids, asked in items:
            rec = call.recording
            rec.calls += 1
            sample.calls += 1
            rec.last = sample
            room = rec.budget - len(sample.tokens)
            limit = room if asked is None else min(asked, room)
            if limit <= 0:
                self._out_of_budget(rec, sample)
                call.future.set_result(self._reply(call, sample, [], [], "length", "", stops))
                continue
            stream = rec.index * CALL_STREAMS + rec.calls
            going.append((call, sample, limit, Prompt(index=stream, text=sample.text, token_ids=ids)))
        if not going:
            return
        p = replace(params, max_tokens=max(g[2] for g in going), stop=stops)
        try:
            outs = sampler.generate([g[3] for g in going], p, 1)
        except Exception as err:
            for call, *_ in going:
                call.future.set_exception(AgentRequestError(f"generation failed: {type(err).__name__}: {err}", 503))
            raise
        for (call, sample, limit, _), row in zip(going, outs):
            c = row[0]
            ids, logprobs = c.token_ids[:limit], c.logprobs[:limit]
            finish = "length" if len(ids) < len(c.token_ids) or c.finish_reason == "length" else c.finish_reason
            raw = self.tokenizer.decode(ids, skip_special_tokens=True)
            sample.take_reply(ids, logprobs, raw, c.weight_version)
            if len(sample.tokens) >= call.recording.budget:
                sample.truncated, finish = True, "length"
            sample.finish = finish
            call.future.set_result(self._reply(call, sample, ids, logprobs, finish, raw, stops))

    def _out_of_budget(self, rec: Recording, sample: Sample) -> None:
        """A call the rollout's budget left no token for: an empty reply, counted, and said once a run
        (its only other trace would be `completion/truncated`)."""
        sample.take_reply([], [], "")
        sample.truncated, sample.finish = True, "length"
        rec.out_of_budget += 1
        if self.told_budget_spent:
            return
        self.told_budget_spent = True
        log.warning(
            "agent %s: call %d of rollout %d got no tokens (finish_reason 'length'): rollout.max_completion_length=%d "
            "is the whole rollout's budget, and its replies and the turns the agent added (%d tokens) spent it. "
            "Raise rollout.max_completion_length, or ask for fewer tokens per call (max_tokens); "
            "agent/calls_out_of_budget counts such calls each round (said once)",
            self.name,
            rec.calls,
            rec.index,
            rec.budget,
            len(sample.tokens),
        )

    def _reply(self, call: Call, sample: Sample, ids, logprobs, finish: str, raw: str, stops: list[str]) -> dict:
        """The OpenAI-shaped answer; records what the agent was shown (the next call must repeat it)."""
        shown = raw
        cut = next((s for s in stops if finish == "stop" and raw.endswith(s)), None)
        if cut:
            shown = raw[: -len(cut)]
        tokens = [self.tokenizer.decode([t]) for t in ids]
        rec = call.recording
        common = {
            "id": f"plait-{rec.index}-{rec.calls}",
            "created": int(time.time()),
            "model": call.body.get("model") or MODEL,
            "usage": {
                "prompt_tokens": len(sample.prompt_ids) + len(sample.tokens) - len(ids),
                "completion_tokens": len(ids),
                "total_tokens": len(sample.prompt_ids) + len(sample.tokens),
            },
        }
        reason = "length" if finish == "length" else "stop"
        if call.kind == "text":
            sample.shown_text += shown
            lp = None
            if call.body.get("logprobs") is not None:
                lp = {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": None}
            choice = {"index": 0, "text": shown, "finish_reason": reason, "logprobs": lp, "token_ids": list(ids)}
            return {**common, "object": "text_completion", "choices": [choice]}
        message: dict[str, Any] = {"role": "assistant", "content": shown}
        calls = [c for c in find_calls(raw, "hermes") if c.problem is None] if sample.tools else []
        if calls:
            message["content"] = shown.split("<tool_call>", 1)[0].strip() or None
            message["tool_calls"] = [
                {
                    "id": f"call_{rec.index}_{rec.calls}_{k}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for k, c in enumerate(calls)
            ]
            reason = "tool_calls" if finish != "length" else reason
        sample.seen = [*call.body["messages"], message]
        sample.messages.append(dict(message))
        lp = None
        if call.body.get("logprobs"):
            lp = {
                "content": [
                    {"token": t, "logprob": x, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, x in zip(tokens, logprobs)
                ]
            }
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": lp, "token_ids": list(ids)}
        return {**common, "object": "chat.completion", "choices": [choice]}

    def _completion(self, rec: Recording) -> Completion:
        """The rollout's training sample: the one its last call built."""
        s = rec.last or Sample("text", list(rec.prompt.token_ids), rec.prompt.text)
        error = None if rec.error is None else f"rollout {rec.index}: {rec.error}"
        versions = [v for v in s.versions if v is not None]
        forked = sum(x.calls for x in rec.samples if x is not s)
        prompt_ids = None if s.prompt_ids == list(rec.prompt.token_ids) else s.prompt_ids
        return Completion(
            prompt_index=rec.prompt.index,
            token_ids=s.tokens,
            text=s.after_prompt,
            model_text=s.model_text,
            logprobs=s.logprobs,
            truncated=s.truncated,
            finish_reason=s.finish,
            weight_version=min(versions, default=None),
            sampled_mask=s.sampled,
            messages=list(s.messages) if s.kind == "chat" and s.messages else None,
            env_reward=rec.reward,
            columns=rec.columns,
            env_error=error,
            prompt_ids=prompt_ids,
            info={
                "agent/calls": float(rec.calls),
                "agent/forks": float(max(0, len(rec.samples) - 1)),
                "agent/forked_calls": float(forked),
                "agent/errors": float(error is not None),
                "agent/calls_out_of_budget": float(rec.out_of_budget),
            },
        )


def _call_agent(fn: Callable, task: AgentTask) -> Any:
    """What the agent returns, run to its end (an `async def` agent on an event loop of its own),
    with the clients it was handed closed after it, however it ended."""
    try:
        out = fn(task)
        if inspect.isawaitable(out):
            out = asyncio.run(_closing(out, task))
    finally:
        task.close_clients()
    return out


async def _closing(awaitable, task: AgentTask):
    try:
        return await awaitable
    finally:  # on this loop, before asyncio.run closes it (see AgentTask.aclose_clients)
        await task.aclose_clients()


def _returned(out: Any) -> tuple[float | None, dict[str, Any] | None]:
    """(reward, columns) from what an agent returned: None, a number (its reward), or a dict of
    `reward` (optional) and columns the reward functions get by name."""
    columns = None
    if isinstance(out, dict):
        bad = [k for k in out if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise TypeError(f"returned a dict with keys {bad!r}; its keys name reward-function parameters")
        columns = {k: v for k, v in out.items() if k != "reward"} or None
        out = out.get("reward")
    if out is None:
        return None, columns
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise TypeError(
            f"returned {type(out).__name__}; return a number (the rollout's reward), None, or a dict of 'reward' "
            "and columns for the reward functions"
        )
    return float(out), columns


def _options(body: dict) -> tuple[int | None, tuple[str, ...]]:
    """(max tokens, stop strings) of a request; what plait can't honour is refused. Sampling
    settings (temperature, top_p...) are the run's: the trainer's log-probs assume them."""
    if body.get("stream"):
        raise AgentRequestError("'stream' is not supported: ask without it")
    if body.get("n", 1) != 1:
        raise AgentRequestError(
            f"'n' must be 1, got {body.get('n')!r}: plait runs rollout.num_generations rollouts of each prompt itself"
        )
    return _max_tokens(body), _stops(body)


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AgentRequestError(f"'{key}' must be a positive integer, got {v!r}")
            return v
    return None


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise AgentRequestError(f"'stop' must be a string or a list of strings, got {stop!r}")


def budget_note(cfg) -> str | None:
    """A note when the agent's own source visibly asks for more than the rollout's budget: the
    max_tokens written in its calls add up to rollout.max_completion_length or more, before the
    turns it adds between them, which count against the budget too (None: not visibly so)."""
    a = cfg.rollout.agent
    if a is None:
        return None
    from plait.programs.calls import resolve_function

    try:
        asked = _asked_tokens(resolve_function(a.function, "agent function"))
    except Exception:  # noqa: BLE001 - one that does not import is plait check's problem, said there
        return None
    budget = cfg.rollout.max_completion_length
    if len(asked) < 2 or sum(asked) < budget:
        return None
    return (
        f"rollout.agent: {a.function}'s calls ask for {' + '.join(map(str, asked))} = {sum(asked)} tokens "
        f"(max_tokens in its source), and rollout.max_completion_length={budget} is the whole rollout's budget, "
        "the turns the agent adds between its calls (their text and the chat template's markup) included: its "
        f"later calls will be cut short or get nothing. Raise rollout.max_completion_length above {sum(asked)} "
        "plus what those turns take"
    )


def _asked_tokens(fn: Callable) -> list[int]:
    """The max_tokens (or max_completion_tokens) written as a number in each call of `fn`'s source,
    in the order they are written ([] when its source can't be read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = [
        (kw.value.lineno, kw.value.col_offset, kw.value.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg in ("max_tokens", "max_completion_tokens")
        and isinstance(kw.value, ast.Constant)
        and type(kw.value.value) is int
    ]
    return [n for *_, n in sorted(found)]
