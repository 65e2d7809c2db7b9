"""A run's rollout setup from its config (`Tools`): the sandbox model-written code runs in, the
tool schemas the chat template shows, the template check, and the run's rollout program
(plait/programs/__init__.py). Multi-turn tool use: docs/tools.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from plait.programs.calls import tool_schemas
from plait.programs.template import ChatTurns, TemplateMismatch, chat_turns, check_template


__all__ = [
    "Tools",
    "ChatTurns",
    "TemplateMismatch",
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


def tool_role(cfg) -> str:
    """The chat role tool outputs are given (a worked example's too)."""
    return cfg.rollout.tools.role if cfg.rollout.tools is not None else "tool"


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


@dataclass
class Tools:
    """A run's rollouts, set up once from its config: the sandbox tool calls run in (built, and
    its tier checked, by `from_config`: fail closed before any model loads), the tool schemas
    the chat template describes, the template check, and the rollout program. Without
    rollout.tools: no schemas, no check."""

    cfg: Any
    tokenizer: Any
    sandbox: Any = None  # plait.sandbox.box.Sandbox, when something the model writes runs
    schemas: list[dict] | None = None
    envs: Any = None  # plait.programs.trl_env.TrlEnvironments: the run's trl_env entries

    @classmethod
    def from_config(cls, cfg, tokenizer) -> Tools:
        from plait.programs.environments import tool_environments

        t = cfg.rollout.tools
        schemas = tool_schemas(t)
        envs = tool_environments(cfg, schemas) if t is not None else None
        boxed = tools_need_sandbox(t) or (envs is not None and envs.needs_sandbox)
        sandbox = tool_sandbox(cfg) if boxed else None
        if envs is not None:
            envs.sandbox = sandbox
        return cls(cfg, tokenizer, sandbox, schemas, envs)

    @property
    def enabled(self) -> bool:
        return self.cfg.rollout.tools is not None

    def describe(self) -> str | None:
        """One line for the run's header (None without tools, an agent or a program of your own)."""
        if self.cfg.rollout.program is not None:
            return f"rollout program: {self.cfg.rollout.program} (your own: docs/environments.md)"
        a = self.cfg.rollout.agent
        if a is not None:
            from plait.programs.agent import budget_note

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

    def program(self):
        """The run's rollout program (a fresh one per call: the trainer's and an asynchronous
        producer's each hold their own)."""
        from plait.programs import ProgramSetup, make_program

        return make_program(ProgramSetup(self.cfg, self.tokenizer, self.sandbox, self.envs))
