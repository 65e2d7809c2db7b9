"""OpenEnv environments (`type: openenv`, tests/helpers/openenv_envs.py, real openenv-core classes):
in the trainer's process and through a real OpenEnv server (uvicorn, its /ws protocol) with the
same outcomes: one episode per rollout, the `step` tool with the action's schema, the episode's
return as the reward; the model's bad actions shown to it; the environment's failures
(a raising reset, a hung step, a lost server, a full server past its wait) left unscored; a full
server waited for; config mistakes and a down server refused before a model loads; and a real
`plait train` run on a server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from test_trl_env import env_config, rollouts, rows_file, scores, two_process_run

from plait.comm import free_port
from plait.config.checks import check_environments, check_tools, probe
from plait.data import DataError, build_prompts, load_rows
from plait.programs import openenv
from plait.programs.openenv import tool_kind as openenv_kind
from plait.programs.tools import Tools


pytest.importorskip("openenv.core")

ROWS = [{"prompt": "Guess.", "target": 5}, {"prompt": "Guess again.", "target": 9}]


def call(args: dict) -> str:
    return f'<tool_call>{{"name": "step", "arguments": {json.dumps(args)}}}</tool_call>'


SCRIPT = [call({"guess": 3}), call({"guess": 5}), "Done.<eos>"]
TOOLS = "rollout.tools={format: hermes, python: false"  # the section an openenv entry implies, to add to


class Server:
    """A real OpenEnv server for tests/helpers/openenv_envs.py, in its own process."""

    def __init__(self, helper_env, env_name="GuessEnv", sessions=8):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**helper_env, "PLAIT_TEST_OPENENV": env_name, "PLAIT_TEST_OPENENV_SESSIONS": str(sessions)}
        cmd = [sys.executable, "-m", "uvicorn", "openenv_envs:app", "--port", str(self.port), "--log-level", "warning"]
        self.log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would stop the server mid-test
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while True:  # up when its /health answers
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the OpenEnv server did not come up in 120 s"
            time.sleep(0.1)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def server(helper_env):
    s = Server(helper_env)
    yield s
    s.stop()


@pytest.fixture(params=["local", "server"])
def where(request):
    """An entry's location: the class in this process, or the module's server."""
    if request.param == "local":
        return "factory: 'openenv_envs:GuessEnv'"
    return f"url: '{request.getfixturevalue('server').url}'"


def entry(where: str, **more) -> str:
    fields = "".join(f", {k}: {v}" for k, v in more.items())
    return f"{{type: openenv, name: guess, {where}{fields}}}"


def test_each_rollout_plays_its_own_episode_and_its_return_is_the_reward(tmp_path, tok, where):
    cfg = env_config(rows_file(tmp_path, ROWS), entry(where))
    assert cfg.rollout.tools.format == "hermes" and cfg.rewards[0].name == "environment"
    prompts, groups = rollouts(cfg, tok, SCRIPT)
    assert prompts[0].messages[-1]["content"] == "Guess. Guess the number from 1 to 9 with the step tool."
    (schema,) = openenv_kind(cfg.environments[0], "guess", 5.0).schemas
    assert schema["function"]["name"] == "step"
    assert schema["function"]["parameters"]["properties"]["guess"]["type"] == "integer"
    assert schema["function"]["parameters"]["required"] == ["guess"]
    assert "Guess the hidden number" in schema["function"]["description"]
    said = [[m["content"] for m in c.messages if m["role"] == "tool"] for g in groups for c in g.completions]
    assert said == [["higher", "right"]] * 2 + [["higher", "higher"]] * 2  # each rollout its own episode
    # the return: -0.25 per wrong guess, +1 for the right one
    assert [c.env_reward for g in groups for c in g.completions] == [0.75, 0.75, -0.5, -0.5]
    assert scores(groups) == [0.75, 0.75, -0.5, -0.5]
    assert all(c.env_error is None for g in groups for c in g.completions)


def test_a_bad_action_a_raising_step_and_a_step_after_the_end_are_the_models_doing(tmp_path, tok, where):
    more_turns = [TOOLS + ", max_turns: 6}"]
    cfg = env_config(rows_file(tmp_path, ROWS[:1]), entry(where), extra=more_turns)
    script = [call({"guess": "five"}), call({"guess": 13}), call({"guess": 5}), call({"guess": 5}), "Done.<eos>"]
    _, groups = rollouts(cfg, tok, script, n=1)
    (c,) = groups[0].completions
    said = [m["content"] for m in c.messages if m["role"] == "tool"]
    assert "guess" in said[0] and "int" in said[0]  # pydantic's validation error, shown to the model
    assert "13 is not a number this game takes" in said[1]
    assert said[2] == "right"
    assert "the episode is over" in said[3]
    assert c.env_error is None and c.info["tools/errors"] == 3
    assert scores(groups) == [1.0]


def test_the_environments_own_failures_are_infrastructure_errors_not_scores(tmp_path, tok, helper_env):
    broken = env_config(rows_file(tmp_path, ROWS), entry("factory: 'openenv_envs:BrokenResetEnv'"))
    _, groups = rollouts(broken, tok, SCRIPT)
    assert all("the game's database is down" in c.env_error for g in groups for c in g.completions)
    assert scores(groups) == [None] * 4

    lone = Server(helper_env)
    try:
        cfg = env_config(rows_file(tmp_path, ROWS[:1]), entry(f"url: '{lone.url}'"), extra=[TOOLS + ", timeout_s: 2}"])
        _, groups = rollouts(cfg, tok, [call({"guess": 0}), "Done.<eos>"], n=1)  # the step sleeps 30 s
        (c,) = groups[0].completions
        assert "step ran past 2.0s" in c.env_error and scores(groups) == [None]

        episode = openenv_kind(cfg.environments[0], "guess", 10.0).factory()
        assert "Guess the number" in episode.reset(prompt="Guess.", target=5)
        assert episode.step(guess=4) == "higher"
        lone.stop()  # the server dies mid-episode
        with pytest.raises(openenv.EnvironmentLost, match="was lost"):
            episode.step(guess=5)
        assert "was lost" in episode.infrastructure_error
        episode.close()
    finally:
        lone.stop()


def test_a_full_server_is_waited_for_then_refused_with_the_limit_named(tmp_path, helper_env):
    one = Server(helper_env, sessions=1)
    try:
        cfg = env_config(rows_file(tmp_path, ROWS), entry(f"url: '{one.url}'", connect_timeout_s=60))
        kind = openenv_kind(cfg.environments[0], "guess", 10.0)
        first, second = kind.factory(), kind.factory()
        first.reset(prompt="Guess.", target=5)
        got = {}
        waiting = threading.Thread(target=lambda: got.update(text=second.reset(prompt="Guess.", target=9)))
        waiting.start()
        assert first.step(guess=5) == "right"  # the first session works while the second is refused
        assert waiting.is_alive() and not got
        first.close()  # frees the server's one session: the second gets it
        waiting.join(60)
        assert "Guess the number" in got["text"] and second.step(guess=9) == "right"

        hurried = env_config(rows_file(tmp_path, ROWS), entry(f"url: '{one.url}'", connect_timeout_s=0.5))
        third = openenv_kind(hurried.environments[0], "guess", 10.0).factory()
        with pytest.raises(openenv.EnvironmentLost, match="refused a session for 0.5s.*max_concurrent_envs"):
            third.reset(prompt="Guess.")
        second.close()
        third.close()
    finally:
        one.stop()


@pytest.fixture(scope="module")
def tools_server(helper_env):
    s = Server(helper_env, "GuessToolsEnv")
    yield s
    s.stop()


@pytest.mark.parametrize("place", ["local", "server"])
def test_an_mcp_environment_offers_its_own_tools(tmp_path, tok, place, request):
    """An MCPEnvironment (RFC 003): its tools, listed by a list_tools step, are the model's tools;
    each call is a call_tool step; a tool's error goes back to the model; rewards sum as for step."""
    if place == "local":
        where = "factory: 'openenv_envs:GuessToolsEnv'"
    else:
        where = f"url: '{request.getfixturevalue('tools_server').url}'"
    cfg = env_config(rows_file(tmp_path, ROWS), entry(where), extra=[TOOLS + ", max_turns: 6}"])
    kind = openenv_kind(cfg.environments[0], "guess", 5.0)
    assert kind.tools == ["guess", "hint"]
    guess = kind.schemas[0]["function"]
    assert (
        guess["parameters"]["properties"]["n"]["type"] == "integer"
        and "Guess the hidden number" in guess["description"]
    )

    def use(name, args):
        return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>'

    script = [use("hint", {}), use("guess", {"n": 13}), use("guess", {"n": 3}), use("guess", {"n": 5}), "Done.<eos>"]
    prompts, groups = rollouts(cfg, tok, script, n=1)
    assert prompts[0].messages[-1]["content"].endswith("Find the number from 1 to 9 with the guess and hint tools.")
    said = [[m["content"] for m in c.messages if m["role"] == "tool"] for g in groups for c in g.completions]
    assert [s[0] for s in said] == ["odd", "odd"]
    assert all("13 is not a number this game takes" in s[1] for s in said)
    assert [s[2:] for s in said] == [["higher", "right"], ["higher", "higher"]]
    assert scores(groups) == [0.75, -0.5]


def test_config_mistakes_and_a_down_server_are_refused_before_a_model_loads(tmp_path, server):
    path = rows_file(tmp_path, ROWS)

    def problems(*envs, extra=()):
        cfg = env_config(path, *envs, extra=extra)
        env = probe(cfg, 1)
        return check_environments(cfg, env) + check_tools(cfg, env)

    assert problems(entry(f"url: '{server.url}'")) == []
    assert problems(entry("factory: 'openenv_envs:GuessEnv'")) == []
    down = problems(entry(f"url: 'http://127.0.0.1:{free_port()}'"))
    assert any("could not read the OpenEnv server's /schema" in p and "start the server first" in p for p in down)
    not_openenv = problems(entry("factory: 'trl_envs:CounterEnv'"))
    assert any("not an OpenEnv Environment" in p and "use type: trl_env" in p for p in not_openenv)
    with pytest.raises(Exception, match="needs one of `factory: module:Name`"):
        env_config(path, entry(f"url: '{server.url}', factory: 'openenv_envs:GuessEnv'"))
    with pytest.raises(Exception, match="not in plait's sandbox"):
        env_config(path, entry("factory: 'openenv_envs:GuessEnv'", trusted="false"))
    with pytest.raises(Exception, match="`url` is for environments of type openenv"):
        env_config(path, "{type: trl_env, factory: 'trl_envs:CounterEnv', url: 'http://x'}")


def test_a_reset_that_fails_when_the_prompts_are_built_stops_the_run_with_the_row(tmp_path, tok):
    """plait check can't reset (reset takes a row's columns); building the prompts, before the
    model loads, resets on each row and stops at the first that fails, naming it."""
    cfg = env_config(rows_file(tmp_path, ROWS), entry("factory: 'openenv_envs:DownEnv'"))
    assert check_environments(cfg, probe(cfg, 1)) == []
    tools = Tools.from_config(cfg, tok)
    said = "row 0: environment 'guess' could not reset on it when the prompts were built: .*the game's database is down"
    with pytest.raises(DataError, match=said):
        build_prompts(load_rows(cfg.data, "train"), tok, cfg.data, tools=tools.schemas, envs=tools.envs)


def test_a_run_trains_on_an_openenv_server(tmp_path, tiny_model_path, server, helper_env):
    """`plait train` end to end on the server, generating asynchronously (k = 1: the episodes are
    opened from rank 0's producer thread, the model runs in the generation process): the header
    says where the environment runs, every rollout is an episode (env/<label>/* metrics, no
    errors), and the final evaluation plays too."""
    rows = [{"prompt": "Guess.", "target": t} for t in range(1, 9)]
    path = rows_file(tmp_path, rows)
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "plait", "train",
        "--set", f"model.name_or_path={tiny_model_path}",
        "--set", f"data.path={path}", "--set", f"data.eval_path={path}",
        "--set", f"environments=[{entry(f'url: {server.url!r}')}]",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.num_generations=4",
        "--set", "rollout.max_completion_length=48", "--set", "train.max_steps=2",
        "--set", "train.micro_batch_size=4", "--set", "train.precision=fp32", "--set", "eval.before=false",
        "--set", "rollout.max_staleness=1", "--set", "log.console=plain", "--set", f"output_dir={out}",
    ]  # fmt: skip
    res = subprocess.run(cmd, env={**os.environ, **helper_env}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"environments: guess ({server.url}: tools step, get_reward, on its server)" in res.stdout
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    assert [m["async/scheduled_version"] for m in rounds] == [0, 0]  # round 2 sampled before round 1's update
    for m in rounds:
        assert m["env/guess/completions"] == 8 and m["env/guess/errors"] == 0
    (after,) = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert after["n"] == 8 and after["environment"] == after["env/guess"]


def test_a_run_on_an_openenv_environment_resumes_exactly(tiny_model_path, tmp_path):
    """4 rounds straight == 2 rounds, a crash in round 3, resume, 2 more (the class in this
    process): the same final weights and the same sampled tokens every round."""
    from test_train import assert_resumed_exactly, crash_then_resume

    rows = rows_file(tmp_path, [{"question": f"Guess {t}.", "target": t} for t in range(1, 9)])
    envs = [f"environments=[{entry('factory: openenv_envs:GuessEnv')}]", "rollout.max_completion_length=24"]
    straight, crashed, result = crash_then_resume(tiny_model_path, (rows, rows), tmp_path, *envs)
    assert len(result.history) == 2 and all(m["env/guess/errors"] == 0 for m in result.history)
    assert_resumed_exactly(straight, crashed)


def test_two_training_processes_share_an_openenv_server(tiny_model_path, tmp_path, server, helper_env):
    """torchrun, 2 processes: every rank's rollouts are episodes on the one server, counted once
    in the round's metrics (8 per round), with no environment error."""
    rows = rows_file(tmp_path, [{"question": f"Guess {t}.", "target": t} for t in range(1, 9)])
    rounds = two_process_run(tiny_model_path, rows, tmp_path / "run", helper_env, entry(f"url: {server.url!r}"))
    for m in rounds:
        assert m["env/guess/completions"] == 8 and m["env/guess/errors"] == 0
