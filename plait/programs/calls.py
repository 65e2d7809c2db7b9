"""Tool calls: finding them in a model's turn, and running them.

Two call formats:
- python: the turn ends with a fenced ```python block; the block is a cell of a Python session
  in the sandbox;
- hermes: the turn holds <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the format
  of the Qwen2.5/Qwen3/Hermes chat templates); each names a function tool, `python` included.

The Python session replays: a call runs, in a fresh sandboxed process, every earlier cell of
the same completion (their output hidden) and then the new one. A persistent interpreter per
completion would have to live across the generation of a whole round, hold a sandbox open per
conversation and be rebuilt from nothing after a restart; a replayed cell needs none of that,
leaves no process behind between calls (so a hostile cell can't act between turns), and gives
the same output again when a resumed run regenerates the round (`random` is seeded; the
sandbox caches identical programs). A cell that did not finish (past its time limit, or it
ended or killed the interpreter) is left out of later replays, as if the session had been
restarted without it. The price: earlier cells run again, so a session of k
calls executes k(k+1)/2 cells, and a cell whose output depends on the clock or on the
environment differs from what a live session would show.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from plait.imports import import_module, nearest


PYTHON_STOP = "```\n"  # ends a turn at a closing fence; a call is a python block that ends the turn
HERMES_STOP = "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_LANGS = ("python", "py", "python3")


@dataclass
class Call:
    """One tool call: the tool's name and its arguments (`problem` set when it could not be read)."""

    name: str
    arguments: dict
    problem: str | None = None


@dataclass
class ToolResult:
    output: str
    status: str = "ok"  # ok | error (the call failed: an exception, bad arguments) | timeout
    seconds: float = 0.0
    finished: bool = True  # False: the interpreter did not get to the end (timeout, killed, exited)


def python_call(text: str) -> str | None:
    """The code of the python block that ends `text` (trailing whitespace allowed), or None."""
    t = text.rstrip()
    if not t.endswith("```"):
        return None
    start = t.rfind("```", 0, len(t) - 3)
    if start < 0:
        return None
    header, newline, body = t[start + 3 : -3].partition("\n")
    if not newline or header.strip().lower() not in PYTHON_LANGS:
        return None
    return body.rstrip("\n")


def hermes_calls(text: str) -> list[Call]:
    """Every <tool_call> JSON object in `text`, in order (a malformed one comes back with its problem)."""
    calls = []
    for raw in _HERMES.findall(text):
        try:
            obj = json.loads(raw)
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                raise ValueError('expected {"name": "...", "arguments": {...}}')
            calls.append(Call(obj["name"], args))
        except (ValueError, AttributeError) as err:
            calls.append(Call("?", {}, f"could not read the tool call {raw[:200]!r}: {err}"))
    return calls


def find_calls(text: str, fmt: str) -> list[Call]:
    """The tool calls a model turn ends with (none: the model answered)."""
    if fmt == "python":
        code = python_call(text)
        return [] if code is None else [Call("python", {"code": code})]
    return hermes_calls(text)


def cut(output: str, limit: int) -> str:
    """`output` cut to `limit` characters, saying how much was dropped."""
    if len(output) <= limit:
        return output
    return output[:limit] + f"\n... ({len(output) - limit} more characters cut)"


# ---- the Python session ---------------------------------------------------------------

# Runs in the sandbox: replay the earlier cells silently, run the last one and show its
# output, as a notebook would (a last bare expression prints its repr; a traceback shows
# the cell's own frames only).
SESSION = """
import ast as _ast, contextlib as _cl, io as _io, os as _os, random as _random, sys as _sys, traceback as _tb
_random.seed(0)
_pid = _os.getpid()
_cells = {cells!r}
_ns = {{"__name__": "__main__"}}
_failed = False
def _run(_i, _src, _show):
    global _failed
    try:
        _tree = _ast.parse(_src, f"<cell {{_i}}>")
        _last = _tree.body.pop() if _show and _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
        exec(compile(_tree, f"<cell {{_i}}>", "exec"), _ns)
        if _last is not None:
            _value = eval(compile(_ast.Expression(_last.value), f"<cell {{_i}}>", "eval"), _ns)
            if _value is not None:
                print(repr(_value))
    except BaseException as _e:
        if _show:
            _failed = True
            _where = None if isinstance(_e, SyntaxError) else _e.__traceback__.tb_next  # not ast's own frames
            _tb.print_exception(type(_e), _e, _where, file=_sys.stdout)
    finally:
        if _os.getpid() != _pid:  # a process the cell forked ends with the cell: later cells run once
            _sys.stdout.flush()
            _os._exit(0)
for _i, _src in enumerate(_cells[:-1], 1):
    with _cl.redirect_stdout(_io.StringIO()), _cl.redirect_stderr(_io.StringIO()):
        _run(_i, _src, False)
_run(len(_cells), _cells[-1], True)
"""

SESSION_OK = "assert not _failed"  # run by the harness after the session: reports over its private channel

PYTHON_TOOL_DOC = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandboxed session and see what it prints; variables defined by "
        "earlier calls stay defined. A last bare expression shows its value.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}


def sandbox_output(res) -> ToolResult:
    """A sandbox ExecResult as the tool's output."""
    gap = "\n" if res.stdout and res.stderr and not res.stdout.endswith("\n") else ""
    text = res.stdout + gap + res.stderr
    if res.status == "timeout":
        return ToolResult(text + "\nTimeoutError: the call ran past its time limit", "timeout", res.wall_s, False)
    if res.status == "error":
        return ToolResult(f"the sandbox could not run this call: {res.error}", "error", res.wall_s, False)
    if res.status != "exited":
        return ToolResult(text + f"\nthe call was stopped: {res.status.replace('_', ' ')}", "error", res.wall_s, False)
    if not res.finished:  # an exception while loading (function tools), os._exit(), a killed interpreter
        why = "\n".join(res.errors) or "the session ended before the call finished"
        return ToolResult(text + ("\n" if text else "") + why, "error", res.wall_s, False)
    return ToolResult(text, "ok" if res.all_passed else "error", res.wall_s)


# ---- running calls ----------------------------------------------------------------------


def function_schema(fn: Callable) -> dict:
    """A function's JSON schema from its type hints and docstring (transformers' get_json_schema,
    what TRL uses); a TypeError names what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 - DocstringParsingException and friends
        raise TypeError(
            f"tool function {fn.__module__}.{fn.__name__}: {err} (a tool needs type hints on every argument and "
            "a Google-style docstring with an Args: section)"
        ) from err


def resolve_function(spec: str, kind: str = "tool function") -> Callable:
    """'module:function' -> the function (ValueError/ImportError say what is wrong, calling it
    `kind`: a tool function, an agent function...)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{kind} {spec!r}: write it as 'module:function'")
    found = import_module(module)
    fn = getattr(found, attr, None)
    if not callable(fn):
        raise ValueError(f"{kind} {spec!r}: module '{module}' has no function '{attr}'{nearest(found, attr)}")
    return fn


def resolve_factory(spec: str) -> Callable:
    """'module:Name' -> the factory (ValueError / ImportError say what is wrong)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr or "." in attr:
        raise ValueError(f"environment factory {spec!r}: write it as 'module:Name' (a class or a function)")
    factory = getattr(import_module(module), attr, None)
    if not callable(factory):
        raise ValueError(f"environment factory {spec!r}: module '{module}' has no callable '{attr}'")
    return factory


class ToolRunner:
    """Runs the calls of one run's completions: Python cells in `sandbox` (replayed per
    completion), function tools in this process (`trusted`) or in the sandbox."""

    def __init__(self, tools_cfg, sandbox=None, functions: dict[str, Callable] | None = None):
        self.cfg = tools_cfg
        self.sandbox = sandbox
        self.functions = functions or {}

    def run(self, call: Call, cells: list[str], env=None) -> ToolResult:
        """Run `call`; `cells` is this completion's Python history (a python call appends to it),
        `env` its environment (a trl_env Session, whose methods are tools too)."""
        started = time.monotonic()
        if call.problem is not None:
            res = ToolResult(call.problem, "error")
        elif call.name == "python" and self.cfg.python:
            code = call.arguments.get("code")
            if not isinstance(code, str):
                res = ToolResult("python needs one argument, code (a string)", "error")
            else:
                res = sandbox_output(self.sandbox.execute(SESSION.format(cells=[*cells, code]), [SESSION_OK]))
                if res.finished:  # a cell that never ended (or ended the interpreter) is not replayed
                    cells.append(code)
        elif env is not None and call.name in env.kind.tools:
            res = env.call(call)
        elif call.name in self.functions:
            res = self._function(call)
        else:
            offered = (["python"] if self.cfg.python else []) + sorted(self.functions)
            offered += sorted(env.kind.tools) if env is not None else []
            res = ToolResult(f"there is no tool named {call.name!r} (tools: {', '.join(offered) or 'none'})", "error")
        res.output = cut(res.output, self.cfg.max_output_chars)
        res.seconds = time.monotonic() - started
        return res

    def _function(self, call: Call) -> ToolResult:
        fn = self.functions[call.name]
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as err:
            return ToolResult(f"{call.name}: {err}", "error")
        if not self.cfg.trusted_functions:
            program = _function_program(fn, call.arguments)
            return sandbox_output(self.sandbox.execute(program, ["pass"]))
        return _call_trusted(fn, call.arguments, self.cfg.timeout_s)


def _function_program(fn: Callable, arguments: dict) -> str:
    """A sandbox program: the function's module source, then the call, printing its result."""
    source = inspect.getsource(inspect.getmodule(fn))
    return (
        f"{source}\n\nimport json as _json\n_value = {fn.__name__}(**_json.loads({json.dumps(arguments)!r}))\n"
        "print(_value if isinstance(_value, str) else _json.dumps(_value, default=repr))\n"
    )


def _call_trusted(fn: Callable, arguments: dict, timeout_s: float) -> ToolResult:
    """Call a trusted function on a thread of its own (see call_on_thread)."""
    status, value = call_on_thread(fn, arguments, timeout_s)
    if status == "timeout":
        return ToolResult(f"TimeoutError: {fn.__name__} ran past {timeout_s}s", "timeout")
    return ToolResult(value if status == "error" else as_text(value), status)


def awaited(value):
    """`value`, or what it resolves to when it is awaitable (an async function's result)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def call_on_thread(fn: Callable, kwargs: dict, timeout_s: float) -> tuple[str, Any]:
    """('ok', value), ('error', 'Type: message') or ('timeout', None): `fn(**kwargs)` (async or
    not) on a thread of its own, abandoned past `timeout_s` (a thread can't be killed: trusted
    code only, the user's own, known to return)."""
    box: dict = {}

    def target():
        try:
            box["value"] = awaited(fn(**kwargs))
        except BaseException as err:  # noqa: BLE001 - the model sees the error, as it would see a traceback
            box["error"] = f"{type(err).__name__}: {err}"

    worker = threading.Thread(target=target, name=f"plait-tool-{getattr(fn, '__name__', 'call')}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "timeout", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("value")


def as_text(value) -> str:
    """A tool's return value as the text the model sees (JSON where it can be)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


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
