"""Environments in TRL's environment_factory form (`type: trl_env`, tests/helpers/trl_envs.py):
one instance per rollout reset with its row, its methods called as tools, its get_reward the
`environment` reward; in the trainer's process (trusted) and replayed in the sandbox, with the
same outcomes; infrastructure errors left unscored; config mistakes refused before a model
loads; and a real `plait train` run on one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_tools import Scripted

from plait.config import load_config
from plait.config.checks import check_environments, check_tools, probe
from plait.config.schema import RewardSpec
from plait.data import DataError, build_prompts, load_rows
from plait.programs.environments import environment, error_share_problem, round_errors
from plait.programs.tools import Tools
from plait.rewards.runner import bind_rewards, reward_inputs, score_groups
from plait.train.metrics import environment_metrics
from plait.types import Group, SamplingParams


ROWS = [
    {"prompt": "Count up.", "target": 5},
    {"prompt": "Count again.", "target": 9},
]

# the model adds 2, then 3, then answers: 5 reaches the first row's target, not the second's
SCRIPT = [
    '<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"n": 3}}</tool_call>',
    "Done.<eos>",
]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def rows_file(tmp_path, rows=ROWS):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def env_config(path, *envs, extra=()):
    entries = ", ".join(envs)
    return load_config(
        None,
        [
            f"data.path={path}",
            f"data.eval_path={path}",
            f"environments=[{entries}]",
            "sandbox.min_tier=process",
            *extra,
        ],
    )


def counter(factory="CounterEnv", trusted=False, **more):
    fields = "".join(f", {k}: {v}" for k, v in more.items())
    return f"{{type: trl_env, factory: 'trl_envs:{factory}', trusted: {str(trusted).lower()}{fields}}}"


def rollouts(cfg, tok, script=SCRIPT, n=2):
    tools = Tools.from_config(cfg, tok)
    prompts = build_prompts(load_rows(cfg.data, "train"), tok, cfg.data, tools=tools.schemas, envs=tools.envs)
    out = tools.program().run(Scripted(tok, script), prompts, SamplingParams(max_tokens=300, seed=3), n)
    return prompts, [Group(p, cs) for p, cs in zip(prompts, out)]


def scores(groups):
    inputs = reward_inputs(groups)
    return environment(completions=inputs.texts, **inputs.kwargs)


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "sandbox-replay"])
def test_each_rollout_gets_its_own_environment_and_get_reward_scores_it(tmp_path, tok, trusted):
    cfg = env_config(rows_file(tmp_path), counter(trusted=trusted))
    assert cfg.rollout.tools.format == "hermes" and cfg.rewards[0].name == "environment"
    prompts, groups = rollouts(cfg, tok)
    # reset's text is appended to the last user message; the row's label goes with it
    assert prompts[0].messages[-1]["content"] == "Count up. Reach 5 with the add tool."
    assert (
        prompts[0].env_observation == " Reach 5 with the add tool."
        and prompts[0].columns["environment"] == "CounterEnv"
    )
    for g in groups:
        for c in g.completions:
            said = [m["content"] for m in c.messages if m["role"] == "tool"]
            assert said == ["2", "5"]  # state lasts across the calls of one rollout, and only of one
            assert c.env_error is None and c.info["tools/calls"] == 2
    assert [c.env_reward for g in groups for c in g.completions] == [1.0, 1.0, 0.0, 0.0]
    assert scores(groups) == [1.0, 1.0, 0.0, 0.0]


def test_a_wrong_call_is_the_models_error_and_an_unknown_tool_names_the_environments(tmp_path, tok):
    cfg = env_config(rows_file(tmp_path), counter(trusted=True))
    script = [
        '<tool_call>{"name": "add", "arguments": {"m": 2}}</tool_call>',
        '<tool_call>{"name": "_helper", "arguments": {}}</tool_call>',
        "Done.<eos>",
    ]
    _, groups = rollouts(cfg, tok, script, n=1)
    said = [m["content"] for m in groups[0].completions[0].messages if m["role"] == "tool"]
    assert said[0] == "add: missing a required argument: 'n'"
    assert said[1] == "there is no tool named '_helper' (tools: add)"
    assert scores(groups) == [0.0, 0.0]  # scored: the environment worked, the model did not reach 5


def test_a_reset_that_shows_each_rollout_other_text_is_an_infrastructure_error(tmp_path, tok):
    cfg = env_config(rows_file(tmp_path), counter("MoodyEnv", trusted=True, name="moody"))
    _, groups = rollouts(cfg, tok)
    completions = [c for g in groups for c in g.completions]
    assert all("the rollouts of a prompt must see the same text" in c.env_error for c in completions)
    assert scores(groups) == [None] * 4
    assert "the rollouts of a prompt must see the same text" in round_errors(groups)["moody"]


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "sandbox-replay"])
def test_a_failing_get_reward_is_not_a_score_and_stops_the_run_past_its_share(tmp_path, tok, trusted):
    cfg = env_config(rows_file(tmp_path), counter("BrokenRewardEnv", trusted=trusted, name="broken"))
    _, groups = rollouts(cfg, tok)
    assert scores(groups) == [None] * 4
    assert all("the scorer is down" in c.env_error for g in groups for c in g.completions)
    # every reward, not only `environment`, leaves such a rollout unscored; the round counts it
    score_groups(groups, bind_rewards([RewardSpec(name="environment"), RewardSpec(name="boxed_format")]))
    assert all(v is None for g in groups for vals in g.rewards.values() for v in vals)
    assert environment_metrics(groups)["env/broken/errors"] == 4.0
    metrics = {"env/broken/errors": 4.0, "env/broken/completions": 4.0}
    stop = error_share_problem(cfg.environments, metrics, 3, errors=round_errors(groups))
    assert "environment 'broken' failed to score 4 of its 4 completions in round 3" in stop
    assert "the scorer is down" in stop
    # the error is the round's, handed in: nothing another run or test left behind is quoted
    assert "see the warnings above" in error_share_problem(cfg.environments, metrics, 3)


def test_a_row_picks_its_environment_and_its_prompt_shows_only_that_ones_tools(tmp_path, tok):
    rows = [{"prompt": "Count.", "target": 2, "environment": "counter"}, {"prompt": "Say hi.", "environment": "echo"}]
    path = rows_file(tmp_path, rows)
    cfg = env_config(
        path,
        counter(name="counter"),
        counter("EchoEnv", name="echo"),
        extra=["rewards=[{name: boxed_format}]", "eval.metric=boxed_format"],
    )
    tools = Tools.from_config(cfg, tok)
    assert [
        s["function"]["name"]
        for s in tools.envs.schemas_for(build_prompts(rows[:1], tok, cfg.data, envs=tools.envs)[0])
    ] == ["add"]
    prompts = build_prompts(rows, tok, cfg.data, tools=tools.schemas, envs=tools.envs)
    assert [p.columns["environment"] for p in prompts] == ["counter", "echo"]
    # SmolLM2's template ignores `tools`: the run's log says the model is not shown them
    assert "does not show the tools' schemas to the model" in tools.check(prompts)
    script = ['<tool_call>{"name": "echo", "arguments": {"word": "hi"}}</tool_call>', "Done.<eos>"]
    out = tools.program().run(Scripted(tok, script), prompts, SamplingParams(max_tokens=200), 1)
    (counted,), (echoed,) = out
    assert [m["content"] for m in echoed.messages if m["role"] == "tool"] == ["HI"]
    assert [m["content"] for m in counted.messages if m["role"] == "tool"][0].startswith(
        "there is no tool named 'echo'"
    )
    with pytest.raises(DataError, match="names environment 'nope'; each row must name one of the environments"):
        build_prompts([{"prompt": "x", "environment": "nope"}], tok, cfg.data, envs=tools.envs)
    with pytest.raises(DataError, match="has no `environment` column"):
        build_prompts([{"prompt": "x"}], tok, cfg.data, envs=tools.envs)


def test_config_mistakes_are_refused_before_a_model_loads(tmp_path):
    path = rows_file(tmp_path)

    def problems(*envs, extra=()):
        cfg = env_config(path, *envs, extra=extra)
        env = probe(cfg, 1)
        return check_environments(cfg, env) + check_tools(cfg, env)

    assert problems(counter()) == []
    assert any(
        "set rollout.tools.format=hermes" in p for p in problems(counter(), extra=["rollout.tools={format: python}"])
    )
    no_reward = problems(counter("EchoEnv"))
    assert any("trl_envs:EchoEnv has none: name your rewards" in p for p in no_reward)
    missing = problems("{type: trl_env, factory: 'trl_envs:Nowhere'}")
    assert any("module 'trl_envs' has no callable 'Nowhere'" in p for p in missing)
    mixed = problems(counter(), "{type: reasoning_gym, dataset: basic_arithmetic}")
    assert any("one run takes one kind" in p for p in mixed)
    with pytest.raises(
        Exception, match="`weight` is for environments of type reasoning_gym, not trl_env .*takes its rows from `data`"
    ):
        env_config(path, counter(weight=2))
    with pytest.raises(Exception, match="needs `factory: module:Name`"):
        env_config(path, "{type: trl_env}")


def counting(target: int, first: int) -> list[dict]:
    """A conversation that reaches `target` with two calls of CounterEnv's add tool."""

    def call(n):
        return f'<tool_call>\n{{"name": "add", "arguments": {{"n": {n}}}}}\n</tool_call>'

    return [
        {"role": "user", "content": f"Count up. Reach {target} with the add tool."},
        {"role": "assistant", "content": call(first)},
        {"role": "tool", "content": str(first)},
        {"role": "assistant", "content": call(target - first)},
        {"role": "tool", "content": str(target)},
        {"role": "assistant", "content": "Done."},
    ]


@pytest.fixture(scope="module")
def counting_model(tiny_model_path, tmp_path_factory):
    """The tiny model, taught the shape of a counting conversation (its numbers stay uncertain)."""
    from tool_model import made_once, teach

    conversations = [counting(t, f) for t in range(2, 12) for f in range(1, t)]
    return made_once(
        tmp_path_factory, "counting-model", lambda out: teach(tiny_model_path, out, conversations, steps=120, batch=8)
    )


def test_a_run_trains_on_an_environment_in_the_sandbox(tmp_path, counting_model, helper_env):
    """`plait train` end to end with a model that calls the environment's tool, generating
    asynchronously (k = 1: the environments live in rank 0's producer thread, the model in the
    generation process): the header says where the environment runs, every round's rollouts call
    `add` and are scored by get_reward (env/<label>/* metrics, no errors), and the final
    evaluation (the trainer's own engine) goes through the environment too."""
    rows = [{"prompt": "Count up.", "target": t} for t in range(2, 12)]
    path = rows_file(tmp_path, rows)
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "plait", "train",
        "--set", f"model.name_or_path={counting_model}",
        "--set", f"data.path={path}", "--set", f"data.eval_path={path}",
        "--set", "environments=[{type: trl_env, factory: 'trl_envs:CounterEnv', name: counter}]",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.num_generations=4",
        "--set", "rollout.max_completion_length=96", "--set", "train.max_steps=2",
        "--set", "train.micro_batch_size=4", "--set", "train.precision=fp32", "--set", "eval.before=false",
        "--set", "rollout.max_staleness=1", "--set", "sandbox.min_tier=process", "--set", "log.console=plain",
        "--set", f"output_dir={out}",
    ]  # fmt: skip
    res = subprocess.run(cmd, env=helper_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "environments: counter (trl_envs:CounterEnv: tools add, get_reward, in the sandbox by replay)" in res.stdout
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    assert [m["async/scheduled_version"] for m in rounds] == [0, 0]  # round 2 sampled before round 1's update
    for m in rounds:
        assert m["env/counter/completions"] == 8 and m["env/counter/errors"] == 0
        assert m["tools/calls_per_completion"] > 0  # some malformed (tools/errors): the model's doing, not the env's
    (after,) = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert after["n"] == 10 and after["environment"] == after["env/counter"]  # greedy, through the environment


def test_a_run_on_a_trl_env_environment_resumes_exactly(tiny_model_path, tmp_path):
    """4 rounds straight == 2 rounds, a crash in round 3, resume, 2 more (trusted: in this
    process): the same final weights and the same sampled tokens every round."""
    from test_train import assert_resumed_exactly, crash_then_resume

    rows = rows_file(tmp_path, [{"question": "Count up.", "target": t} for t in range(2, 10)])
    envs = [f"environments=[{counter(trusted=True)}]", "rollout.max_completion_length=24"]
    straight, crashed, result = crash_then_resume(tiny_model_path, (rows, rows), tmp_path, *envs)
    assert len(result.history) == 2 and all(m["env/CounterEnv/errors"] == 0 for m in result.history)
    assert_resumed_exactly(straight, crashed)


def test_two_training_processes_each_replay_their_environments_in_the_sandbox(tiny_model_path, tmp_path, helper_env):
    """torchrun, 2 processes, the environment replayed in the sandbox: every rank's rollouts get
    an environment, counted once in the round's metrics (8 per round), with no environment error."""
    rows = rows_file(tmp_path, [{"question": "Count up.", "target": t} for t in range(2, 10)])
    extra = ["sandbox.min_tier=process", "rollout.max_completion_length=24"]
    rounds = two_process_run(tiny_model_path, rows, tmp_path / "run", helper_env, counter(), *extra)
    for m in rounds:
        assert m["env/CounterEnv/completions"] == 8 and m["env/CounterEnv/errors"] == 0


def two_process_run(model, rows, out, helper_env, environment: str, *extra) -> list[dict]:
    """2 rounds of the tiny model under torchrun, 2 processes, on `environment` over `rows`: the
    rounds' metrics (the run must end well)."""
    from test_train import tiny_overrides
    from test_vllm import train_cmd

    args = tiny_overrides(model, (rows, rows), out, f"environments=[{environment}]", "train.max_steps=2", *extra)
    res = subprocess.run(train_cmd(2, args), env=helper_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    return rounds
