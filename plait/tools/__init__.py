"""Multi-turn tool use (docs/tools.md): the model calls tools mid-answer and learns from it.

calls.py     finding calls in a turn (python blocks, hermes <tool_call>), running them
template.py  the text between turns, and the check that the chat template appends
engine.py    ToolEngine: any rollout engine, made multi-turn (token in, token out)
environments.py  environment classes in TRL's environment_factory form (`type: trl_env`)
openenv.py   OpenEnv environments (`type: openenv`), in this process or on their server
rollout_func.py  your own rollout loop (`rollout.rollout_func`), TRL's rollout_func
agent.py     any agent program as the rollout (`rollout.agent`): its calls recorded and linked
endpoint.py  the OpenAI-compatible endpoint those agents call
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from plait.tools.calls import PYTHON_TOOL_DOC, ToolRunner, function_schema, resolve_function
from plait.tools.engine import ToolEngine
from plait.tools.template import ChatTurns, TemplateMismatch, check_template


__all__ = [
    "Tools",
    "ToolEngine",
    "ChatTurns",
    "TemplateMismatch",
    "with_tools",
    "tool_schemas",
    "chat_turns",
    "check_tools",
]

# the conversation the template check plays (an earlier turn with reasoning in it, as templates
# that drop earlier reasoning would show)
PROBE_TURNS = {
    "python": ["<think>\nMultiply.\n</think>\nLet me compute it.\n```python\nprint(6 * 7)\n```\n", "So \\boxed{42}."],
    "hermes": [
        '<think>\nMultiply.\n</think>\n<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n'
        "</tool_call>",
        "So \\boxed{42}.",
    ],
}


def tools_need_sandbox(tools_cfg) -> bool:
    """Does something the model writes run? (the Python tool, or functions not marked trusted)"""
    return tools_cfg is not None and (
        tools_cfg.python or (bool(tools_cfg.functions) and not tools_cfg.trusted_functions)
    )


def tool_functions(tools_cfg) -> dict[str, Callable]:
    """The configured function tools by name."""
    fns = [resolve_function(spec) for spec in tools_cfg.functions]
    return {fn.__name__: fn for fn in fns}


def tool_schemas(tools_cfg) -> list[dict] | None:
    """What the chat template describes to the model: the JSON schema of every tool (format
    hermes); None for format python (the prompt says how to write a python block)."""
    if tools_cfg is None or tools_cfg.format != "hermes":
        return None
    schemas = [PYTHON_TOOL_DOC] if tools_cfg.python else []
    return schemas + [function_schema(fn) for fn in tool_functions(tools_cfg).values()]


def tool_role(cfg) -> str:
    """The chat role tool outputs are given (a worked example's too)."""
    return cfg.rollout.tools.role if cfg.rollout.tools is not None else "tool"


def chat_turns(cfg, tokenizer) -> ChatTurns | None:
    """Tool turns rendered by the run's chat template; None when prompts are plain text."""
    own = cfg.data.chat_template if isinstance(cfg.data.chat_template, str) else None
    if not cfg.data.chat_template or not (own or tokenizer.chat_template):
        return None
    return ChatTurns(tokenizer, own, tool_schemas(cfg.rollout.tools), cfg.rollout.tools.role)


def check_tools(cfg, tokenizer, prompts, envs=None) -> str | None:
    """Before any model loads: the chat template must render a conversation by appending (see
    template.py); ValueError says why not and what to do. Returns a warning when the template
    does not show the tools' schemas to the model."""
    t = cfg.rollout.tools
    turns = chat_turns(cfg, tokenizer)
    if turns is None:
        if t.format == "hermes":
            raise ValueError("rollout.tools.format=hermes needs a chat template (data.chat_template true or a string)")
        return None
    first = prompts[0]
    if envs is not None:
        turns = turns.with_tools(envs.schemas_for(first))
    try:
        check_template(turns, first.messages, first.text, PROBE_TURNS[t.format])
    except TemplateMismatch as err:
        raise ValueError(
            f"rollout.tools: this chat template can't be used for multi-turn rollouts: {err}. Training on it would "
            "use contexts the model never sees when the conversation is rendered whole. Give a template that "
            "renders by appending (data.chat_template: a Jinja string), or set data.chat_template: false."
        ) from err
    if not turns.describes_tools(first.messages):
        return (
            "rollout.tools: this chat template does not show the tools' schemas to the model (it ignores "
            "`tools`); describe them in the prompt or data.system_prompt, or give a template that renders them"
        )
    return None


def tool_sandbox(cfg):
    """The sandbox tool calls run in: the run's sandbox settings with the tools' time limit
    (built, and its isolation tier checked, now: fail closed before any model loads)."""
    from plait.sandbox.box import Sandbox, sandbox_settings

    settings = sandbox_settings(cfg.sandbox)
    settings.limits = dataclasses.replace(settings.limits, timeout_s=cfg.rollout.tools.timeout_s)
    return Sandbox(settings)


def with_tools(cfg, engine, tokenizer, sandbox=None, envs=None):
    """`engine` as it is without rollout.tools, else wrapped in a ToolEngine (with `envs`, the
    run's trl_env environments, one per rollout)."""
    t = cfg.rollout.tools
    if t is None:
        return engine
    runner = ToolRunner(t, sandbox, tool_functions(t))
    turns = chat_turns(cfg, tokenizer)
    return ToolEngine(engine, tokenizer, t, runner, turns, workers=cfg.sandbox.workers, envs=envs)


@dataclass
class Tools:
    """A run's tool use, set up once from its config: the sandbox tool calls run in (built, and
    its tier checked, by `from_config`: fail closed before any model loads), the tool schemas
    the chat template describes, the template check, and the wrapping of engines. Without
    rollout.tools it is inert: no schemas, no check, engines returned as they are."""

    cfg: Any
    tokenizer: Any
    sandbox: Any = None  # plait.sandbox.box.Sandbox, when something the model writes runs
    schemas: list[dict] | None = None
    envs: Any = None  # plait.tools.environments.TrlEnvironments: the run's trl_env entries

    @classmethod
    def from_config(cls, cfg, tokenizer) -> Tools:
        from plait.tools.environments import TrlEnvironments

        t = cfg.rollout.tools
        schemas = tool_schemas(t)
        envs = TrlEnvironments.from_config(cfg, schemas) if t is not None else None
        boxed = tools_need_sandbox(t) or (envs is not None and envs.needs_sandbox)
        sandbox = tool_sandbox(cfg) if boxed else None
        if envs is not None:
            envs.sandbox = sandbox
        return cls(cfg, tokenizer, sandbox, schemas, envs)

    @property
    def enabled(self) -> bool:
        return self.cfg.rollout.tools is not None

    def describe(self) -> str | None:
        """One line for the run's header (None without tools or an agent)."""
        a = self.cfg.rollout.agent
        if a is not None:
            from plait.tools.agent import budget_note

            port = a.port or "a free port"
            line = f"agent: {a.function}, a call per rollout, through an OpenAI-compatible endpoint on {a.host}:{port}"
            note = budget_note(self.cfg)
            return line if note is None else f"{line}\n{note}"
        if not self.enabled:
            return None
        where = f"sandbox tier '{self.sandbox.tier}'" if self.sandbox else "this process (trusted functions)"
        line = f"tools: {self.cfg.rollout.tools.format} calls, run in {where}"
        return line if self.envs is None else f"{line}\n{self.envs.describe()}"

    def check(self, prompts) -> str | None:
        """The chat template must append turns (ValueError says why not); nothing without tools.
        Returns a warning for the run's log, if any."""
        return check_tools(self.cfg, self.tokenizer, prompts, self.envs) if self.enabled else None

    def wrap(self, engine):
        """`engine` made multi-turn (a ToolEngine), or driven by the user's rollout_func or agent, or as it is."""
        from plait.tools import agent, rollout_func

        engine = rollout_func.wrap(
            self.cfg, with_tools(self.cfg, engine, self.tokenizer, self.sandbox, self.envs), self.tokenizer
        )
        return agent.wrap(self.cfg, engine, self.tokenizer)
