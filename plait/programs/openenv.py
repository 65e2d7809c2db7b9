"""OpenEnv environments (`type: openenv`): reset/step with a typed action, in this process or on a server.

An entry names one of:

- `factory: module:Name`: an OpenEnv `Environment` class (or a function of no arguments that
  makes one), run in the trainer's process, one instance per rollout;
- `url: http://HOST:PORT`: an OpenEnv server the user started (`uvicorn server.app:app`, `openenv
  serve`), one session per rollout on its `/ws` WebSocket, the protocol OpenEnv's own EnvClient
  speaks (messages `reset`, `step`, `close`; replies `observation` or `error`).

plait drives it through its trl_env machinery (plait/programs/trl_env.py), as a class in TRL's
environment_factory form that it writes for the entry:

- `reset(**row)` is the environment's `reset(seed, episode_id, **row)`: the seed is the row's
  `seed` column, else a hash of the row, so every rollout of a prompt sees the same episode;
  the reset observation, as text, is appended to the prompt;
- one tool, `step`, whose arguments are the action's fields (the action class's JSON schema,
  its docstring the description); what the model sees back is the observation as text;
- `get_reward()` is the episode's return: the sum of the rewards its observations carried
  (None counts 0). Once an observation says `done`, a further step is refused (the model sees so).

An action that fails the action class's validation, or a step that raises, is the model's doing:
it sees the error. The environment's own failures are infrastructure errors, never a score (the
rollout's reward is None, `env/<label>/errors` counts it): a reset that raises, a server that
can't be reached, a session the server refuses past `connect_timeout_s` (a full server,
CAPACITY_REACHED, is retried until then), a connection lost mid-episode, a step that runs past
the tool timeout (the session is then in an unknown state).
"""

from __future__ import annotations

import inspect
import json
import time
import typing
import uuid
import zlib
from urllib.parse import urlsplit

from plait.programs.calls import as_text, awaited, cut, resolve_factory
from plait.programs.trl_env import EnvKind


# the OpenEnv server's error codes that are the action's fault (WSErrorCode)
MODEL_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR")
RETRIED = ("CAPACITY_REACHED",)


class EnvironmentLost(RuntimeError):
    """The environment itself failed (not the model's action): the rollout is an infrastructure error."""


class ActionRefused(RuntimeError):
    """The environment refused the model's action (validation, or the step raised): the model sees it."""


def observation_text(fields: dict) -> str:
    """An observation as the model reads it: its one text field, else its fields as JSON."""
    shown = {k: v for k, v in fields.items() if v not in (None, "", [], {})}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown, default=repr)


def tool_result_text(result) -> str:
    """An MCP tool's result as the model reads it: its value (FastMCP's `data`), else its text content."""
    if not isinstance(result, dict):
        return as_text(result)
    if result.get("data") is not None:
        return as_text(result["data"])
    texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    return "\n".join(texts) if texts else as_text(result)


def episode_seed(kwargs: dict) -> int:
    """The row's `seed` column, else a stable hash of the row: the same episode for every rollout of a prompt."""
    if isinstance(kwargs.get("seed"), int):
        return kwargs["seed"]
    return zlib.crc32(json.dumps(kwargs, sort_keys=True, default=repr).encode())


def accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments `fn` takes (all of them when it takes **kwargs), as OpenEnv's server passes them."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def action_class(env_cls: type):
    """The action class an Environment class's `step` takes (its type hint), else OpenEnv's base Action."""
    from openenv.core.env_server.types import Action

    try:
        hint = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # noqa: BLE001 - an unresolvable hint: fall back to the base class
        hint = None
    return hint if isinstance(hint, type) and issubclass(hint, Action) else Action


def step_schema(action_schema: dict) -> dict:
    """The `step` tool's function schema from the action's JSON schema (less OpenEnv's `metadata` field)."""
    props = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
    params = {
        "type": "object",
        "properties": props,
        "required": [r for r in action_schema.get("required", []) if r in props],
    }
    if "$defs" in action_schema:
        params["$defs"] = action_schema["$defs"]
    doc = (action_schema.get("description") or "").strip()
    return {
        "type": "function",
        "function": {
            "name": "step",
            "description": "Act in the environment" + (f": {doc}" if doc else "") + ". Returns what it observes.",
            "parameters": params,
        },
    }


class LocalSession:
    """One episode of an Environment instance in this process."""

    def __init__(self, factory, action_cls):
        self.env = factory()
        self.action_cls = action_cls

    def reset(self, kwargs: dict) -> dict:
        try:
            return payload(awaited(self.env.reset(**accepted(self.env.reset, kwargs))))
        except Exception as err:
            raise EnvironmentLost(f"reset raised {type(err).__name__}: {err}") from err

    def connect(self) -> None:
        """Nothing to open: the instance is here."""

    def step(self, action: dict) -> dict:
        from openenv.core.env_server.serialization import deserialize_action
        from pydantic import ValidationError

        try:
            typed = deserialize_action(action, self.action_cls)
        except ValidationError as err:
            raise ActionRefused(f"the action is not a valid {self.action_cls.__name__}: {err}") from err
        try:
            return payload(awaited(self.env.step(typed)))
        except Exception as err:
            raise ActionRefused(f"{type(err).__name__}: {err}") from err

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def payload(observation) -> dict:
    """An Observation as the server sends it: its fields, reward and done."""
    fields = observation.model_dump(exclude={"reward", "done", "metadata"})
    return {"observation": fields, "reward": observation.reward, "done": observation.done}


class RemoteSession:
    """One episode on an OpenEnv server: a WebSocket session on its /ws."""

    def __init__(self, url: str, connect_timeout_s: float, message_timeout_s: float):
        self.url = ws_url(url)
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self.ws = None

    def reset(self, kwargs: dict) -> dict:
        """Open a session and reset it; a full server (CAPACITY_REACHED) is asked again until connect_timeout_s."""
        deadline = time.monotonic() + self.connect_timeout_s
        wait = 0.05
        while True:
            try:
                self._connect(deadline)
                return self._ask({"type": "reset", "data": kwargs}, "reset")
            except _Refused as refused:
                self.close()
                if time.monotonic() + wait > deadline:
                    raise EnvironmentLost(
                        f"the OpenEnv server at {self.url} refused a session for {self.connect_timeout_s:g}s: "
                        f"{refused}; let it hold more sessions (max_concurrent_envs) or raise connect_timeout_s"
                    ) from None
                time.sleep(wait)  # the server frees a session when another rollout closes its own
                wait = min(2 * wait, 1.0)

    def connect(self) -> None:
        """Open a session without resetting it."""
        self._connect(time.monotonic() + self.connect_timeout_s)

    def _connect(self, deadline: float) -> None:
        from websockets.sync.client import connect

        local = urlsplit(self.url).hostname in ("localhost", "127.0.0.1", "::1")
        try:  # a server on this machine is reached directly, whatever proxy the environment names
            self.ws = connect(
                self.url,
                open_timeout=max(0.1, deadline - time.monotonic()),
                max_size=None,
                proxy=None if local else True,
            )
        except Exception as err:  # noqa: BLE001 - refused, unresolvable, timed out: all say the server is not there
            raise EnvironmentLost(
                f"could not reach the OpenEnv server at {self.url}: {type(err).__name__}: {err}"
            ) from err

    def step(self, action: dict) -> dict:
        return self._ask({"type": "step", "data": action}, "step")

    def _ask(self, message: dict, what: str) -> dict:
        from websockets.exceptions import ConnectionClosed

        try:
            try:
                self.ws.send(json.dumps(message))
            except ConnectionClosed:
                pass  # a full server says why and closes at once: its reason may wait to be read
            reply = json.loads(self.ws.recv(timeout=self.message_timeout_s))
        except TimeoutError:
            raise EnvironmentLost(f"{what}: the server did not answer in {self.message_timeout_s:g}s") from None
        except Exception as err:  # noqa: BLE001 - a closed or broken connection
            lost = f"the session on {self.url} was lost ({type(err).__name__}: {err})"
            if what == "reset" and isinstance(err, ConnectionClosed):
                raise _Refused(lost) from err  # closed before it began: asked again, as a full server is
            raise EnvironmentLost(f"{what}: {lost}") from err
        if reply.get("type") != "error":
            return reply.get("data", {})
        data = reply.get("data") or {}
        said = f"{data.get('message', 'no message')} ({data.get('code', 'no code')})"
        if data.get("errors"):
            said += f": {cut(json.dumps(data['errors'], default=repr), 600)}"
        if data.get("code") in RETRIED:
            raise _Refused(said)
        if what == "step" and data.get("code") in MODEL_ERRORS:
            raise ActionRefused(said)
        raise EnvironmentLost(f"{what}: the server answered {said}")

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.ws.send(json.dumps({"type": "close"}))
            except Exception:  # noqa: BLE001 - best effort: the server ends the session when the socket closes
                pass
            self.ws.close()
            self.ws = None


class _Refused(Exception):
    """The server refused the session (at capacity): asked again."""


def ws_url(url: str) -> str:
    base = url.rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(plain):
            base = secure + base[len(plain) :]
    if not base.startswith(("ws://", "wss://")):
        base = "ws://" + base
    return base if base.endswith("/ws") else base + "/ws"


class Episode:
    """One rollout's environment in TRL's environment_factory form (what the trl_env machinery runs)."""

    def __init__(self, open_session):
        self._open = open_session
        self._session = None
        self._return = 0.0
        self._done = False
        self.infrastructure_error: str | None = None  # the environment failed: the rollout is not scored

    def reset(self, **row) -> str | None:
        self._session = self._open()
        kwargs = {**row, "seed": episode_seed(row), "episode_id": uuid.uuid4().hex}
        try:
            first = self._session.reset(kwargs)
        except EnvironmentLost as err:
            self.infrastructure_error = str(err)
            raise
        return self._take(first)

    def step(self, **action) -> str:
        return self._take(self._act(action))

    def call_tool(self, name: str, arguments: dict) -> str:
        """An MCP tool's call (a call_tool step): its result as text; its error goes to the model."""
        reply = self._act({"type": "call_tool", "tool_name": name, "arguments": arguments})
        self._take(reply)
        fields = reply.get("observation") or {}
        if fields.get("error"):
            error = fields["error"]
            raise ActionRefused(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        return tool_result_text(fields.get("result"))

    def _act(self, action: dict) -> dict:
        if self._done:
            raise ActionRefused("the episode is over (the environment said done); answer without another call")
        try:
            return self._session.step(action)
        except EnvironmentLost as err:
            self.infrastructure_error = str(err)
            raise

    def _take(self, reply: dict) -> str:
        reward = reply.get("reward")
        self._return += float(reward) if reward is not None else 0.0
        self._done = bool(reply.get("done"))
        return observation_text(reply.get("observation") or {})

    def get_reward(self) -> float:
        return self._return

    def close(self) -> None:
        if self._session is not None:
            self._session.close()


def fetch_schema(url: str, timeout_s: float) -> dict:
    """GET /schema of an OpenEnv server: {'action': ..., 'observation': ..., 'state': ...} JSON schemas."""
    import httpx

    base = ws_url(url)[: -len("/ws")].replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    try:
        res = httpx.get(base + "/schema", timeout=timeout_s)
        res.raise_for_status()
        return res.json()
    except Exception as err:  # noqa: BLE001 - down, refused, not an OpenEnv server
        raise EnvironmentLost(
            f"could not read the OpenEnv server's /schema at {base}: {type(err).__name__}: {err} (start the server "
            "first, and give its base URL, e.g. http://127.0.0.1:8000)"
        ) from err


def opener(spec, timeout_s: float):
    """(a function that opens one episode's session, the action's JSON schema, where the environment
    runs) for an entry: from the server's /schema, or from the Environment class in this process."""
    if spec.url:
        schema = fetch_schema(spec.url, spec.connect_timeout_s)["action"]

        def open_session():  # the tool timeout, not the socket's, says when a step has hung
            return RemoteSession(spec.url, spec.connect_timeout_s, timeout_s + 5)

        tools = listed_tools(open_session) if "tool_name" in schema.get("properties", {}) else None
        return open_session, schema, tools, spec.url
    from openenv.core.env_server.interfaces import Environment

    factory = resolve_factory(spec.factory)
    probe = factory()
    if not isinstance(probe, Environment):
        raise TypeError(
            f"{spec.factory} made a {type(probe).__name__}, not an OpenEnv Environment (openenv.core.env_server."
            "interfaces.Environment); for a class in TRL's environment_factory form use type: trl_env"
        )
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    action_cls = action_class(type(probe))

    def open_local():
        return LocalSession(factory, action_cls)

    tools = listed_tools(open_local) if isinstance(probe, MCPEnvironment) else None
    return open_local, action_cls.model_json_schema(), tools, spec.factory


def listed_tools(open_session) -> list[dict]:
    """An MCP environment's tools (a `list_tools` step), as function schemas."""
    session = open_session()
    try:  # no reset: its arguments are a row's, and listing tools needs none
        session.connect()
        reply = session.step({"type": "list_tools"})
    except _Refused as refused:
        raise EnvironmentLost(f"the OpenEnv server refused a session to list its tools: {refused}") from None
    finally:
        session.close()
    tools = (reply.get("observation") or {}).get("tools")
    if not isinstance(tools, list):
        raise EnvironmentLost(f"list_tools answered {cut(json.dumps(reply, default=repr), 300)}, not a list of tools")
    clash = [t["name"] for t in tools if t["name"] in EPISODE_NAMES or t["name"].startswith("_")]
    if clash:
        raise ValueError(f"MCP tools named {clash} clash with plait's episode methods {EPISODE_NAMES}: rename them")
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


EPISODE_NAMES = ("reset", "step", "get_reward", "close", "infrastructure_error")


def episode_class(tools: list[dict] | None) -> type:
    """Episode, or (an MCP environment) an Episode with one method per tool, each a call_tool step."""
    if tools is None:
        return Episode

    def method(name: str):
        def call(self, **arguments) -> str:
            return self.call_tool(name, arguments)

        call.__name__ = name
        return call

    names = [t["function"]["name"] for t in tools]
    return type("MCPEpisode", (Episode,), {n: method(n) for n in names})


def tool_kind(spec, label: str, timeout_s: float) -> EnvKind:
    """An openenv entry as the tool loop runs it (environments.KINDS): one tool, `step`, with the
    action's schema (an MCP environment: its own tools); an Episode per rollout, whose return is
    its reward."""
    open_session, schema, tools, where = opener(spec, timeout_s)
    schemas = tools if tools is not None else [step_schema(schema)]
    cls = episode_class(tools)
    return EnvKind(
        label=label,
        spec=where,
        factory=lambda: cls(open_session),
        cls=cls,
        tools=[t["function"]["name"] for t in schemas],
        schemas=schemas,
        has_reward=True,
        trusted=True,
        max_error_share=spec.max_error_share,
        reset_timeout_s=spec.connect_timeout_s + timeout_s,
        episodic=True,
    )


def problems(spec, label: str) -> list[str]:
    """`plait check` of an openenv entry, before any model loads: the class imports and makes an
    Environment (or the server answers its /schema), and an MCP environment lists its tools. No
    reset: its arguments are a row's; each row's runs when the prompts are built."""
    try:
        tool_kind(spec, label, spec.connect_timeout_s)
    except Exception as err:  # noqa: BLE001 - whatever the environment raises, said with where it came from
        return [f"environment '{label}' ({spec.url or spec.factory}): {type(err).__name__}: {err}"]
    return []
