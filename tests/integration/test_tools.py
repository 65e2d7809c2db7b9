"""Multi-turn tool use for real: model-written cells in the sandbox (state across calls, errors,
a hostile cell, a cell that never ends), turns assembled token-in/token-out and masked, and
training runs of a tiny model that has learned to call the tool (tests/helpers/tool_model.py):
the HF engine, asynchronous generation, two processes with dynamic sampling, and a run killed
in the middle of a multi-turn round that resumes exactly."""

from __future__ import annotations

import json
import signal
import subprocess

import psutil
import pytest
import torch
from test_fault_tolerance import start, wait_for_steps
from test_train import final_weights
from test_vllm import metrics_of, train_cmd
from tool_model import made_once, teach_tool_calls

from plait.config import load_config
from plait.config.schema import ToolsConfig
from plait.programs.calls import Call, ToolRunner
from plait.programs.template import ChatTurns
from plait.programs.tool_loop import ToolLoop
from plait.sandbox import Limits
from plait.sandbox.box import Sandbox, SandboxSettings
from plait.train.batch import collate
from plait.train.loop import train
from plait.types import Completion, Group, Prompt, SamplingParams


@pytest.fixture(scope="module")
def box():
    return Sandbox(SandboxSettings(Limits(timeout_s=5), min_tier="process"))


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tool_model(vllm_model, tmp_path_factory):
    """The tiny model vLLM can run, fine-tuned to call the Python tool."""
    return made_once(tmp_path_factory, "tool-model", lambda out: teach_tool_calls(vllm_model, out))


def python_runner(box, **cfg):
    return ToolRunner(ToolsConfig(**cfg), box)


# ---- the Python session ---------------------------------------------------------------------


def test_the_session_keeps_state_across_calls_and_shows_errors_as_a_notebook(box):
    runner, cells = python_runner(box), []
    assert runner.run(Call("python", {"code": "x = 6\nprint('set')"}), cells).output == "set\n"
    shown = runner.run(Call("python", {"code": "y = x * 7\ny"}), cells)  # a last bare expression shows its value
    assert (shown.status, shown.output) == ("ok", "42\n")
    failed = runner.run(Call("python", {"code": "print('before')\n1 / 0"}), cells)
    assert failed.status == "error"
    assert failed.output.startswith("before\nTraceback") and "ZeroDivisionError: division by zero" in failed.output
    assert "<cell 3>" in failed.output and "harness" not in failed.output  # the cell's own frames only
    exited = runner.run(Call("python", {"code": "import sys\nsys.exit(3)"}), cells)
    assert exited.status == "error" and "SystemExit: 3" in exited.output  # a cell can't end the session
    assert runner.run(Call("python", {"code": "print(x + y)"}), cells).output == "48\n"  # replayed: 'set' not shown
    bad = runner.run(Call("python", {"code": "print(("}), cells)
    assert bad.status == "error" and "SyntaxError" in bad.output and "ast.py" not in bad.output
    assert len(cells) == 6


def test_a_hostile_cell_is_contained_and_the_session_goes_on(box, tmp_path):
    """A cell that kills its parent, forks, writes outside its directory and dials out: each
    fails or dies inside the sandbox, the trainer (this process) is untouched, and the next
    call of the same completion still has the session's state."""

    marker = tmp_path / "escaped"
    runner, cells = python_runner(box), []
    runner.run(Call("python", {"code": "secret = 'kept'"}), cells)
    hostile = (
        "import os, signal, socket\n"
        f"try:\n    open({str(marker)!r}, 'w').write('out')\nexcept OSError as e:\n    print('write refused')\n"
        "try:\n    socket.create_connection(('1.1.1.1', 80), 1)\nexcept OSError:\n    print('no network')\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
        "while True:\n    os.fork()\n"
    )
    res = runner.run(Call("python", {"code": hostile}), cells)
    assert res.status in ("error", "timeout"), res
    assert not marker.exists()
    assert runner.run(Call("python", {"code": "print(secret)"}), cells).output == "kept\n"
    # replayed or not (it may have finished with an error), its forks ran no later cell


def test_a_cell_that_never_ends_times_out_and_the_next_call_works(box):
    runner, cells = python_runner(box), []
    res = runner.run(Call("python", {"code": "n = 1\nwhile True:\n    n += 1"}), cells)
    assert res.status == "timeout" and "TimeoutError: the call ran past its time limit" in res.output
    assert runner.run(Call("python", {"code": "print('next')"}), cells).output == "next\n"
    assert cells == ["print('next')"]  # the cell that never ended is not replayed


def test_a_function_tool_runs_in_the_sandbox_from_its_source(box):
    from tool_functions import broken, multiply

    cfg = ToolsConfig(format="hermes", python=False, functions=["tool_functions:multiply"])
    runner = ToolRunner(cfg, box, {"multiply": multiply, "broken": broken})
    assert runner.run(Call("multiply", {"a": 6, "b": 7}), []).output.strip() == "42"
    failed = runner.run(Call("broken", {"x": 2}), [])
    assert failed.status == "error" and "RuntimeError: broken(2)" in failed.output


# ---- turns, token in / token out --------------------------------------------------------------


class Scripted:
    """A stand-in for the model (the thing under test is the assembly of turns): call k answers
    every row with turn k of the script, tokenized, cut after the first stop string as an engine
    does ('<eos>' ends the turn with the EOS token)."""

    pad_id = 0

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, params: SamplingParams, n: int = 1):
        self.calls.append((prompts, params))
        text = self.script[min(len(self.calls), len(self.script)) - 1]
        eos = text.endswith("<eos>")
        text = text.removesuffix("<eos>")
        finish = "eos" if eos else "length"
        for s in params.stop:
            if s in text:
                text, finish = text[: text.index(s) + len(s)], "stop"
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + (
            [self.tok.eos_token_id] if finish == "eos" else []
        )
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        one = lambda p: Completion(p.index, ids, text, [-0.5] * len(ids), finish == "length", finish)  # noqa: E731
        return [[one(p) for _ in range(n)] for p in prompts]


def chat_prompt(tok, question="What is 6 * 7?") -> Prompt:
    messages = [{"role": "user", "content": question}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Prompt(3, text, tok(text, add_special_tokens=False)["input_ids"], "42", messages=messages)


SCRIPT = [
    "Let me see.\n```python\nx = 6 * 7\n```\nnever sampled",
    "```python\nprint(x)\n```\n",
    "So \\boxed{42}.<eos>",
]


def test_tool_turns_are_masked_and_the_tokens_are_the_whole_conversation(tok, box):
    engine = Scripted(tok, SCRIPT)
    tools = ToolLoop(tok, ToolsConfig(), python_runner(box), ChatTurns(tok))
    prompt = chat_prompt(tok)
    ((c1, c2),) = tools.run(engine, [prompt], SamplingParams(max_tokens=200, seed=5), 2)
    assert [m["role"] for m in c1.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in c1.messages if m["role"] == "tool"] == ["", "42\n"]  # state across calls
    assert c1.info == {
        "tools/calls": 2.0,
        "tools/errors": 0.0,
        "tools/timeouts": 0.0,
        "tools/seconds": c1.info["tools/seconds"],
        "tools/turns": 3.0,
    }
    assert c1.finish_reason == "eos" and not c1.truncated
    # the tokens are what the chat template renders for the whole conversation (and its closing newline)
    whole = tok.apply_chat_template(prompt.messages + c1.messages, tokenize=False)
    assert (
        prompt.token_ids + c1.token_ids + tok("\n", add_special_tokens=False)["input_ids"]
        == tok(whole, add_special_tokens=False)["input_ids"]
    )
    # masked: exactly the tokens plait appended between the turns
    unsampled = [t for t, m in zip(c1.token_ids, c1.sampled_mask) if not m]
    between = "<|im_end|>\n<|im_start|>tool\n<|im_end|>\n<|im_start|>assistant\n"
    between += "<|im_end|>\n<|im_start|>tool\n42\n<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(unsampled) == between
    assert [lp for lp, m in zip(c1.logprobs, c1.sampled_mask) if m] == [-0.5] * sum(c1.sampled_mask)
    batch = collate([Group(prompt, [c1, c2])], pad_id=0)
    assert batch.completion_mask[0, : len(c1.token_ids)].tolist() == c1.sampled_mask
    # later turns continue from the tokens so far, each completion on a random stream of its own
    (later, params) = engine.calls[1]
    assert [p.token_ids for p in later] == [
        prompt.token_ids + c1.token_ids[: len(p.token_ids) - len(prompt.token_ids)] for p in later
    ]
    assert [p.index for p in later] == [3 * 2, 3 * 2 + 1] and params.seed != 5


def test_rewards_read_the_models_turns_not_the_tools_output(tok, box):
    """The tool prints the answer and the model's last turn names none: the text rewards read is
    the model's two turns (a line break between them), so `accuracy` does not take the tool's 42
    for the model's answer; `read: transcript` reads it (the whole conversation, as before)."""
    from plait.rewards.runner import bind_metric, call_reward, reward_inputs

    script = ["```python\nprint(6 * 7)\n```\n", "Done.<eos>"]
    tools = ToolLoop(tok, ToolsConfig(), python_runner(box), ChatTurns(tok))
    ((c,),) = tools.run(Scripted(tok, script), [chat_prompt(tok)], SamplingParams(max_tokens=200), 1)
    assert c.scored_text == "```python\nprint(6 * 7)\n```\n\nDone."
    assert "42" in c.text and "42" not in c.scored_text
    inputs = reward_inputs([Group(chat_prompt(tok), [c])])
    assert inputs.texts == [c.scored_text] and inputs.kwargs["transcript"] == [c.text]
    assert call_reward(bind_metric("accuracy"), inputs) == [0.0]
    transcript = bind_metric("accuracy")
    transcript.kwargs = {"read": "transcript"}
    assert call_reward(transcript, inputs) == [1.0]


def test_hermes_calls_reach_functions_and_the_python_session(tok, box):
    from tool_functions import multiply

    script = [
        '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>',
        '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7 + 1)"}}</tool_call>',
        '<tool_call>{"name": "divide", "arguments": {}}</tool_call>',
        "So \\boxed{42}.<eos>",
    ]
    cfg = ToolsConfig(format="hermes", functions=["tool_functions:multiply"], trusted_functions=True)
    runner = ToolRunner(cfg, box, {"multiply": multiply})
    tools = ToolLoop(tok, cfg, runner, ChatTurns(tok))
    prompt = chat_prompt(tok)
    ((c,),) = tools.run(Scripted(tok, script), [prompt], SamplingParams(max_tokens=300), 1)
    said = [m for m in c.messages if m["role"] == "tool"]
    assert [(m["name"], m["content"].strip()) for m in said[:2]] == [("multiply", "42"), ("python", "43")]
    assert said[2]["content"].startswith("there is no tool named 'divide'")
    assert c.messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    ]
    assert c.info["tools/calls"] == 3 and c.info["tools/errors"] == 1
    rendered = [{k: v for k, v in m.items() if k != "tool_calls"} for m in c.messages]  # the raw call is the content
    whole = tok.apply_chat_template(prompt.messages + rendered, tokenize=False)
    assert tok(whole, add_special_tokens=False)["input_ids"][: len(prompt.token_ids) + len(c.token_ids)] == (
        prompt.token_ids + c.token_ids
    )


def test_without_a_chat_template_the_output_goes_in_as_text_and_eos_ends(tok, box):
    prompt = Prompt(0, "Q: 6 * 7?\nA:", tok("Q: 6 * 7?\nA:", add_special_tokens=False)["input_ids"])
    tools = ToolLoop(tok, ToolsConfig(), python_runner(box), None)
    ((c,),) = tools.run(Scripted(tok, SCRIPT), [prompt], SamplingParams(max_tokens=200), 1)
    assert "```\n```output\n\n```\n```python\nprint(x)\n```\n```output\n42\n\n```\nSo \\boxed{42}." in c.text
    eos_call = ToolLoop(tok, ToolsConfig(), python_runner(box), None)
    ((c,),) = eos_call.run(
        Scripted(tok, ["```python\nprint(1)\n```<eos>"]), [prompt], SamplingParams(max_tokens=200), 1
    )
    assert c.finish_reason == "eos" and c.info["tools/calls"] == 0  # plain text: EOS is the end


def test_the_budget_covers_tool_output_and_max_turns_bounds_the_calls(tok, box):
    prompt = chat_prompt(tok)
    flood = ["```python\nprint('ab' * 500)\n```\n"]
    tools = ToolLoop(tok, ToolsConfig(max_output_chars=2000), python_runner(box), ChatTurns(tok))
    ((c,),) = tools.run(Scripted(tok, flood), [prompt], SamplingParams(max_tokens=60), 1)
    assert len(c.token_ids) == 60 and c.truncated and c.finish_reason == "length"
    assert sum(c.sampled_mask) < 60  # the tool's output took the rest of the budget
    again = ["```python\nprint(1)\n```\n"]
    tools = ToolLoop(tok, ToolsConfig(max_turns=3), python_runner(box), ChatTurns(tok))
    ((c,),) = tools.run(Scripted(tok, again), [prompt], SamplingParams(max_tokens=500), 1)
    assert c.finish_reason == "max_turns" and c.info["tools/calls"] == 2 and c.info["tools/turns"] == 3


def test_a_stop_without_a_whole_call_resumes_the_same_turn(tok, box):
    script = ["Here:\n```\nnot python\n```\n", "and now ```python\nprint(2)\n```\n", "Done.<eos>"]
    tools = ToolLoop(tok, ToolsConfig(), python_runner(box), ChatTurns(tok))
    ((c,),) = tools.run(Scripted(tok, script), [chat_prompt(tok)], SamplingParams(max_tokens=300), 1)
    assert [m["role"] for m in c.messages] == ["assistant", "tool", "assistant"]
    # the opening fence of a plain block stopped the turn; the same turn went on from there
    assert c.messages[0]["content"] == "Here:\n```\n" + script[1] and c.messages[1]["content"] == "2\n"


def test_vllm_and_the_hf_engine_hold_the_same_conversations(tool_model, box):
    """Greedy multi-turn rollouts through the colocated vLLM engine equal the HF engine's: the
    same tokens in every turn, the same calls, the same tool output (vLLM's stop strings and
    token ids, turn by turn, agree with plait's own decoding)."""
    from transformers import AutoModelForCausalLM

    from plait.data import build_prompts, load_rows
    from plait.models import load_tokenizer
    from plait.rollout import make_engine

    tok = load_tokenizer(tool_model)
    cfg = load_config(None, [f"model.name_or_path={tool_model}", "rollout.engine=vllm", "train.precision=fp32"])
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32)
    data = cfg.data.model_copy(update={"task": "multiply", "examples": []})  # the prompts tool_model was taught on
    prompts = build_prompts(load_rows(data, "eval")[:4], tok, data)
    runner, turns = python_runner(box), ChatTurns(tok)
    loop = ToolLoop(tok, ToolsConfig(), runner, turns)
    hf = make_engine(load_config(None, ["train.precision=fp32"]), model, tok)
    vllm = make_engine(cfg, model, tok)
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    try:
        with vllm.weights_for_round(0):
            ours = loop.run(vllm, prompts, greedy, 1)
    finally:
        vllm.close()
    theirs = loop.run(hf, prompts, greedy, 1)
    assert sum(a[0].info["tools/calls"] for a in ours) > 0
    for a, b in zip(ours, theirs):
        assert a[0].token_ids == b[0].token_ids and a[0].sampled_mask == b[0].sampled_mask
        assert a[0].messages == b[0].messages


# ---- training runs -------------------------------------------------------------------------


def tool_run(model, out, *extra):
    return [
        f"model.name_or_path={model}",
        "data.task=multiply",
        "data.examples=[]",  # the bare prompts tool_model was taught to call the tool on
        "data.num_train=64",
        "data.num_eval=4",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=64",
        "rollout.tools={max_turns: 3}",
        "rewards=[{name: accuracy}, {name: boxed_format}]",
        "train.micro_batch_size=4",
        "train.max_steps=2",
        "train.learning_rate=1e-3",
        "train.precision=fp32",
        "eval.before=false",
        "eval.after=false",
        "sandbox.min_tier=process",
        "log.sample_every_steps=1",
        "log.console=plain",
        f"output_dir={out}",
        *extra,
    ]


def run_ok(cmd, env, timeout=900):
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def test_a_run_calls_tools_logs_them_and_rewards_see_the_conversation(tool_model, tmp_path, capsys):
    from plait.cli import main

    out = tmp_path / "run"
    args = tool_run(
        tool_model,
        out,
        "data.conversational=true",
        "rewards=[{name: accuracy}, {name: 'plait_test_rewards:used_a_tool'}]",
    )
    assert main(["train", *(x for a in args for x in ("--set", a))]) == 0
    shown = capsys.readouterr()
    metrics = metrics_of(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["tools/calls_per_completion"] > 0 and 0 < m["tools/used_share"] <= 1
        assert m["tools/turns_mean"] >= max(1.0, m["tools/calls_per_completion"])  # every call follows a model turn
        assert m["tools/output_tokens"] > 0 and m["tools/call_seconds"] > 0
        # the reward that checks for a tool turn in the conversation it is given agrees with the count
        assert m["reward/plait_test_rewards:used_a_tool/mean"] == pytest.approx(m["tools/used_share"])
    assert "tools " in shown.out + shown.err  # the console line shows the calls
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert any(any(t["role"] == "tool" for t in s["conversation"]) for s in samples)
    assert main(["report", str(out)]) == 0
    page = (out / "report" / "index.html").read_text()
    assert "id='fig-tools'" in page and "<b>[tool]</b>" in page  # the tool figure, conversations turn by turn


def test_tools_with_async_generation(tool_model, tmp_path):
    """One round ahead, generated by the HF engine's own process; the tool turns run on rank 0."""
    out = tmp_path / "run"
    train(load_config(None, tool_run(tool_model, out, "rollout.max_staleness=1", "train.max_steps=3")))
    metrics = metrics_of(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["tools/calls_per_completion"] > 0 for m in metrics)


def test_tools_with_two_processes_and_dynamic_sampling(tool_model, tmp_path, helper_env):
    out = tmp_path / "run"
    args = tool_run(tool_model, out, "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2")
    run_ok(train_cmd(2, args), helper_env)
    metrics = metrics_of(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["tools/calls_per_completion"] > 0
        # a second sampling round (a group whose rewards all agreed) generates more groups, tool turns and all
        assert m["sampling/generated_groups"] >= 2 + (m["sampling/rounds"] > 1)


def _in_a_tool_turn(pid: int) -> bool:
    """Is process `pid` running a tool call (a sandbox supervisor among its children: the run's
    rewards execute no code)?"""
    try:
        children = psutil.Process(pid).children()
        return any("supervisor.py" in " ".join(c.cmdline()) for c in children)
    except psutil.Error:
        return False


def test_a_run_killed_in_a_multi_turn_round_resumes_exactly(tool_model, tmp_path, helper_env):
    """SIGKILL while round 3's tool calls run (after step 2's checkpoint): resume=auto
    regenerates the round, tool turns and all, and ends with the weights of an unbroken run."""
    import time

    # At the suite's learning rate (1e-3) the tiny model can stop calling tools by round 3 on
    # some CPU kinds (seen on an Intel Xeon with AMX): then there is no tool turn to kill in. At
    # 1e-5 it keeps calling them, and the weights still change every round. The unbroken run and the
    # resume run in this process, the killed one a process of its own: one thread in all three.
    slow = ("train.learning_rate=1e-5", "train.threads=1")
    straight = tmp_path / "straight"
    train(load_config(None, tool_run(tool_model, straight, "train.max_steps=4", *slow)))
    # the same seed on the same machine: the killed run's round 3 is this one, tool calls and all
    assert metrics_of(straight)[2]["tools/calls_per_completion"] > 0, "round 3 calls no tool: nothing to kill in"
    out = tmp_path / "run"
    saves = ["checkpoint.save_steps=2", "checkpoint.async_save=false"]
    args = tool_run(tool_model, out, "train.max_steps=4", *slow, *saves)
    proc = start(train_cmd(1, args), helper_env, tmp_path / "log")
    wait_for_steps(out, 2, proc)
    deadline = time.monotonic() + 300
    while not _in_a_tool_turn(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-2000:]
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert len(metrics_of(out)) == 2
    train(load_config(None, [*args, "resume=auto"]))
    assert [m["step"] for m in metrics_of(out)] == [1, 2, 3, 4]
    assert [m["tools/calls_per_completion"] for m in metrics_of(out)] == [
        m["tools/calls_per_completion"] for m in metrics_of(straight)
    ]
    a, b = final_weights(straight), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
