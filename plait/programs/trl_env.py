"""Environment classes in TRL's `environment_factory` form (`type: trl_env`), taken unchanged.

The contract (TRL 1.16's GRPOTrainer): a factory (a class, or a function of no arguments)
makes one instance per rollout; `reset(**row)` starts it with the dataset row and may return
text, which is appended to the last user message; its public methods are the tools the model
calls (their type hints and Google-style docstrings are the schemas); an optional `get_reward()`
scores the finished rollout from the environment's state. Methods may be async.

plait runs them on its multi-turn tool loop (plait/programs), hermes calls, in one of two places:

- `trusted: true`: in the trainer's process, one live instance per rollout, as TRL does; a call
  past `rollout.tools.timeout_s` is abandoned and reported as a timeout.
- `trusted: false` (the default): in the sandbox, by replay, as the Python tool runs: each call
  is a fresh sandboxed process that builds an instance from the factory module's source, resets
  it with the row, replays the rollout's earlier calls silently, then makes the new call;
  `get_reward` replays them all. Nothing the model's arguments reach lives between calls. The
  environment must then be deterministic (given the row and the calls) and import only what the
  sandbox's Python has.

What the prompt shows is fixed when the prompts are built: each row's `reset` observation
(computed in the trainer's process, on the row only, with no model input) is rendered into its
prompt, with that environment's tool schemas. A rollout's own `reset` must return the same
text: GRPO compares the completions of one prompt. A different one (an environment that
randomises what it shows) is an infrastructure error for that rollout, as is an environment
that raises in `reset` or `get_reward`: the completion's reward is None, it trains on
nothing, and `env/<label>/errors` counts it. An error a tool call raises is the model's
doing: it sees the error, as a traceback.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from plait.imports import import_module
from plait.programs.calls import (
    Call,
    ToolResult,
    as_text,
    awaited,
    call_on_thread,
    cut,
    function_schema,
    resolve_factory,
    sandbox_output,
)


RESERVED = ("reset", "get_reward")
# the columns a rollout's `reset` does not get: plait's own (the entry a row selects is a
# control field, as in TRL's multi-environment mode)
CONTROL_COLUMNS = ("environment",)


def tool_methods(cls: type) -> list[str]:
    """The public methods of an environment class, which are its tools (TRL lists them on the
    class: listing the instance would evaluate its properties)."""
    return [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if n not in RESERVED and n[0] != "_"]


def reset_kwargs(prompt_source: Any, columns: dict) -> dict:
    """What `reset(**row)` gets: the row's prompt (as the dataset gave it) and its other columns."""
    return {"prompt": prompt_source, **{k: v for k, v in columns.items() if k not in CONTROL_COLUMNS}}


@dataclass
class EnvKind:
    """One trl_env entry, resolved: its factory, tools and their schemas."""

    label: str
    spec: str  # 'module:Name'
    factory: Callable
    cls: type
    tools: list[str]
    schemas: list[dict]
    has_reward: bool
    trusted: bool
    max_error_share: float
    reset_timeout_s: float | None = None  # None: the tool timeout
    # an OpenEnv entry (plait/programs/openenv.py): its instance holds a session to close, reports its
    # own failures in `infrastructure_error`, and a call past the time limit loses the session
    episodic: bool = False

    @classmethod
    def load(cls, spec, label: str) -> EnvKind:
        """Import the factory and make one instance to read its class, as TRL does; TypeError /
        ValueError say what the class lacks."""
        factory = resolve_factory(spec.factory)
        probe = factory()
        kind = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"environment '{label}' ({spec.factory}): its class {kind.__name__} has no reset method")
        names = tool_methods(kind)
        schemas = [function_schema(getattr(probe, n)) for n in names]
        has_reward = callable(getattr(probe, "get_reward", None))
        return cls(label, spec.factory, factory, kind, names, schemas, has_reward, spec.trusted, spec.max_error_share)

    @property
    def place(self) -> str:
        """Where its calls run, as the run header says it."""
        if "://" in self.spec:  # an openenv entry's server URL
            return "on its server"
        return "in this process" if self.trusted else "in the sandbox by replay"

    @functools.cached_property
    def source(self) -> str:
        """The factory module's source, read once: the sandbox runs it for every replayed call."""
        return inspect.getsource(import_module(self.spec.partition(":")[0]))

    def observe(self, kwargs: dict) -> str | None:
        """What `reset(**row)` returns on a fresh instance (in this process: the row only, no model input)."""
        instance = self.factory()
        try:
            observation = awaited(instance.reset(**kwargs))
        finally:
            if self.episodic:
                instance.close()
        if observation is not None and not isinstance(observation, str):
            raise TypeError(
                f"environment '{self.label}': reset returned {type(observation).__name__}; plait takes text "
                "(a str) or None"
            )
        return observation


@dataclass
class Session:
    """One rollout's environment: a live instance (trusted) or the calls to replay (sandbox)."""

    kind: EnvKind
    kwargs: dict
    expected: str | None  # the observation the prompt shows
    timeout_s: float
    sandbox: Any = None
    instance: Any = None
    calls: list[tuple[str, dict]] = field(default_factory=list)  # made so far, that finished
    error: str | None = None  # an infrastructure error: the rollout is not scored

    def open(self) -> Session:
        if self.kind.trusted:
            status, value = call_on_thread(self._start, {}, self.kind.reset_timeout_s or self.timeout_s)
            if status != "ok":
                self.error = f"reset: {value or 'ran past the time limit'}"
        return self

    def _start(self):
        self.instance = self.kind.factory()
        self._check_observation(awaited(self.instance.reset(**self.kwargs)))

    def _check_observation(self, observation) -> None:
        if (observation or None) != (self.expected or None):
            raise RuntimeError(
                f"reset returned {str(observation)[:80]!r} for this rollout but {str(self.expected)[:80]!r} when the "
                "prompt was built; the rollouts of a prompt must see the same text (seed the environment from the row)"
            )

    def call(self, call: Call) -> ToolResult:
        if self.error is not None:
            return ToolResult(f"the environment is unavailable: {self.error}", "error")
        try:
            inspect.signature(getattr(self.kind.cls, call.name)).bind(None, **call.arguments)  # None: self
        except TypeError as err:
            return ToolResult(f"{call.name}: {err}", "error")
        if self.kind.trusted:
            status, value = call_on_thread(getattr(self.instance, call.name), call.arguments, self.timeout_s)
            if self.kind.episodic and (status == "timeout" or self.instance.infrastructure_error):
                self.error = self.instance.infrastructure_error or f"{call.name} ran past {self.timeout_s}s"
            if status == "timeout":
                return ToolResult(f"TimeoutError: {call.name} ran past {self.timeout_s}s", "timeout")
            self.calls.append((call.name, call.arguments))
            return ToolResult(value if status == "error" else as_text(value), status)
        res = sandbox_output(self.sandbox.execute(self._program(call.name, call.arguments), ["pass"]))
        if res.finished:  # a call that never ended is not replayed
            self.calls.append((call.name, call.arguments))
        return res

    def reward(self) -> float | None:
        """get_reward() of the finished rollout; None (and `error` set) when it could not be had."""
        try:
            return self._reward()
        finally:
            if self.kind.episodic and self.instance is not None:
                self.instance.close()

    def _reward(self) -> float | None:
        if self.error is not None or not self.kind.has_reward:
            return None
        if self.kind.trusted:
            status, value = call_on_thread(self.instance.get_reward, {}, self.timeout_s)
            if status != "ok":
                self.error = f"get_reward: {value or 'ran past the time limit'}"
                return None
        else:
            res = self.sandbox.execute(self._program(None, None), ["pass"])
            out = _sandbox_output_text(res)
            try:
                got = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                self.error = f"get_reward in the sandbox gave no answer: {cut(out, 300)}"
                return None
            if got.get("error"):
                self.error = got["error"]
                return None
            value = got["reward"]
        try:
            value = float(value)
        except (TypeError, ValueError):
            self.error = f"get_reward returned {value!r}, not a number"
            return None
        if not math.isfinite(value):
            self.error = f"get_reward returned {value}"
            return None
        return value

    def _program(self, name: str | None, arguments: dict | None) -> str:
        """A sandbox program: the factory's module, a fresh instance reset with the row, the
        earlier calls replayed silently, then the call `name` (None: get_reward, as JSON)."""
        attr = self.kind.spec.partition(":")[2]
        source = self.kind.source
        state = json.dumps({"kwargs": self.kwargs, "calls": self.calls, "expected": self.expected})
        last = (
            f"_value = _ask(getattr(_env, {name!r})(**_json.loads({json.dumps(arguments)!r})))\n"
            "print(_value if isinstance(_value, str) else _json.dumps(_value, default=repr), end='')\n"
            if name is not None
            else "print(_json.dumps(_reward()))\n"
        )
        return f"{source}\n\n{REPLAY.format(state=state, factory=attr)}{last}"


REPLAY = """
import asyncio as _asyncio, contextlib as _cl, inspect as _inspect, io as _io, json as _json
def _ask(_v):
    return _asyncio.run(_v) if _inspect.isawaitable(_v) else _v
_state = _json.loads({state!r})
with _cl.redirect_stdout(_io.StringIO()), _cl.redirect_stderr(_io.StringIO()):
    _env = {factory}()
    _seen = _ask(_env.reset(**_state["kwargs"]))
    for _name, _args in _state["calls"]:
        try:
            _ask(getattr(_env, _name)(**_args))
        except Exception:
            pass
def _reward():
    if (_seen or None) != (_state["expected"] or None):
        return {{"error": "reset returned %r for this rollout but %r when the prompt was built; the rollouts of a "
                 "prompt must see the same text" % (str(_seen)[:80], str(_state["expected"])[:80])}}
    try:
        with _cl.redirect_stdout(_io.StringIO()):
            return {{"reward": _ask(_env.get_reward())}}
    except Exception as _e:
        return {{"error": "get_reward: %s: %s" % (type(_e).__name__, _e)}}
"""


def _sandbox_output_text(res) -> str:
    if res.status == "exited" and res.stdout.strip():
        return res.stdout
    return f"{res.status}: {res.error or res.stderr[-300:]}"


class TrlEnvironments:
    """A run's trl_env entries: which one a row uses, what its prompt shows, and a session per rollout."""

    def __init__(self, kinds: list[EnvKind], timeout_s: float, standalone_schemas: list[dict] | None = None):
        self.kinds = {k.label: k for k in kinds}
        self.timeout_s = timeout_s
        self.standalone = list(standalone_schemas or [])
        self.sandbox = None  # set by whoever owns the run's tool sandbox, when an entry is not trusted

    @property
    def needs_sandbox(self) -> bool:
        return any(not k.trusted for k in self.kinds.values())

    def describe(self) -> str:
        parts = [
            f"{k.label} ({k.spec}: tools {', '.join(k.tools) or 'none'}"
            + (", get_reward" if k.has_reward else "")
            + f", {k.place}"
            + ")"
            for k in self.kinds.values()
        ]
        return "environments: " + "; ".join(parts)

    def kind_of(self, columns: dict, where: str = "a row") -> EnvKind:
        name = columns.get("environment")
        if name is None and len(self.kinds) == 1:
            return next(iter(self.kinds.values()))
        if name is None or str(name) not in self.kinds:
            have = "has no `environment` column" if name is None else f"names environment {name!r}"
            raise ValueError(f"{where} {have}; each row must name one of the environments {sorted(self.kinds)}")
        return self.kinds[str(name)]

    def render(self, source, columns: dict, messages: list[dict], where: str):
        """At prompt build time: (messages with the row's reset observation appended to the last
        user message, the tool schemas its prompt describes, the columns with the entry's
        label, the observation)."""
        kind = self.kind_of(columns, where)
        columns = {**columns, "environment": kind.label}
        try:
            observation = kind.observe(reset_kwargs(source, columns))
        except Exception as err:  # noqa: BLE001 - whatever reset raises stops the run here, said with the row
            raise ValueError(
                f"{where}: environment '{kind.label}' could not reset on it when the prompts were built: "
                f"{type(err).__name__}: {err}"
            ) from err
        if observation:
            last = messages[-1]
            messages = [*messages[:-1], {**last, "content": str(last.get("content", "")) + observation}]
        return messages, self.standalone + kind.schemas, columns, observation

    def schemas_for(self, prompt) -> list[dict]:
        """The tools `prompt`'s rollouts are offered: the run's own and its environment's."""
        return self.standalone + self.kind_of(prompt.columns).schemas

    def open(self, prompt) -> Session | None:
        """A fresh environment for one rollout of `prompt` (None: its row uses none)."""
        if "environment" not in prompt.columns or str(prompt.columns["environment"]) not in self.kinds:
            return None
        kind = self.kinds[str(prompt.columns["environment"])]
        source = prompt.source if prompt.source is not None else prompt.text
        kwargs = reset_kwargs(source, prompt.columns)
        return Session(kind, kwargs, prompt.env_observation, self.timeout_s, self.sandbox).open()


def tool_kind(spec, label: str, timeout_s: float) -> EnvKind:
    """A trl_env entry as the tool loop runs it (environments.KINDS)."""
    return EnvKind.load(spec, label)


def problems(spec, label: str) -> list[str]:
    """`plait check`, before any model loads: the factory imports and makes an instance with a
    reset method, its tools have schemas, and it gives the model something to do."""
    where = f"environment '{label}' ({spec.factory})"
    try:
        kind = EnvKind.load(spec, label)
    except Exception as err:  # noqa: BLE001 - whatever the user's class raises, said with the fix
        return [
            f"{where}: {type(err).__name__}: {err} (the factory must import from where plait runs, make an "
            "instance with no arguments, and its class must have reset(**row) and type-hinted, documented tools)"
        ]
    if not kind.tools and not kind.has_reward:
        return [
            f"{where}: its class has no public methods (tools) and no get_reward: the model could do nothing with it"
        ]
    if not kind.trusted:
        module = spec.factory.partition(":")[0]
        try:
            inspect.getsource(import_module(module))
        except (OSError, TypeError) as err:
            return [
                f"{where}: trusted=false runs it in the sandbox from its module's source, which can't be read ({err})"
            ]
    return []


def config_problems(cfg) -> list[str]:
    """What the rest of the config must be for trl_env entries (each entry's own check is `problems`)."""
    if not any(e.ACTS_ON_ROWS for e in cfg.environments):
        return []
    specs = [e for e in cfg.environments if e.type == "trl_env"]  # an openenv entry always has its reward
    out = []
    tools = cfg.rollout.tools
    if tools is None or tools.format != "hermes":
        out.append(
            "environments of type trl_env and openenv: the model calls their tools as hermes tool calls; set "
            "rollout.tools.format=hermes (with a chat template that renders tools)"
        )
    uses = [r.name for r in cfg.rewards if r.name == "environment"] + (
        ["eval.metric"] if cfg.eval.metric == "environment" else []
    )
    if uses:
        for spec in specs:
            try:
                cls = type(resolve_factory(spec.factory)())
            except Exception:  # noqa: BLE001 - `problems` reports it
                continue
            if not callable(getattr(cls, "get_reward", None)):
                out.append(
                    f"the `environment` reward (in {', '.join(uses)}) is what each environment's get_reward returns, "
                    f"but {spec.factory} has none: name your rewards (and eval.metric) instead"
                )
    return out
