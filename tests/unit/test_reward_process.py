"""Sync reward functions from users' modules run in a process of their own, on its main thread,
as TRL calls them: math-verify with its default (signal-based) time limits works there, a call
past its timeout is killed, and every way a reward can fail is reported by name."""

import os
import sys
import textwrap

import pytest
from open_r1_rewards import ACCURACY_REWARD

from plait.config import Config
from plait.config.checks import check_rewards
from plait.config.schema import RewardSpec
from plait.rewards.runner import RewardError, RewardInputs, bind_rewards, call_rewards, close_rewards


# An Open-R1-style reward file: conversational completions, the `solution` column, math-verify
# with its default timeouts (signal.alarm: main thread only), and a reward class.
REWARDS = (
    ACCURACY_REWARD
    + '''
import os
import sys
import threading

CALLS = []


accuracy_reward = open_r1_accuracy


def where(completions, **kwargs):
    """1.0 when called on a main thread, in a process other than the test's."""
    CALLS.append(1)
    print("a reward printing to stdout")  # must not disturb the protocol
    main = threading.current_thread() is threading.main_thread()
    return [float(main and os.getpid() != int(os.environ["TEST_PID"]))] * len(completions)


class Counter:
    """A reward class: instantiated once, its state kept between calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, trainer_state=None, **kwargs):
        self.calls += 1
        return [self.calls + trainer_state.global_step / 100] * len(completions)


def sleeps(completions, **kwargs):
    import time

    if os.environ.get("PLAIT_REWARD_WORKER") and not os.path.exists(os.environ["TEST_MARKER"]):
        open(os.environ["TEST_MARKER"], "w").close()
        time.sleep(600)
    return [0.5] * len(completions)


def exits(completions, **kwargs):
    sys.exit("giving up")


def dies(completions, **kwargs):
    os._exit(7)


def not_a_list(completions, **kwargs):
    return 0.5


async def awaited(completions, **kwargs):
    return [float(threading.current_thread() is threading.main_thread())] * len(completions)
'''
)


@pytest.fixture()
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "openr1_style_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TEST_PID", str(os.getpid()))
    monkeypatch.setenv("TEST_MARKER", str(tmp_path / "slept"))
    yield "openr1_style_rewards"
    sys.modules.pop("openr1_style_rewards", None)


def _inputs(texts, step=None):
    prompts = [[{"role": "user", "content": "What is 1/2 as a decimal?"}]] * len(texts)
    kwargs = {"prompts": prompts, "solution": ["$0.5$"] * len(texts), "answer": ["0.5"] * len(texts)}
    if step is not None:
        import types

        kwargs["trainer_state"] = types.SimpleNamespace(global_step=step, max_steps=10)
    return RewardInputs(texts, kwargs, conversational=True)


def _bind(*specs):
    return bind_rewards([RewardSpec(**s) for s in specs])


def test_open_r1_math_reward_runs_unchanged_in_its_own_process(rewards_module):
    """math-verify's default parse raises 'doesn't support threaded environment' off the main
    thread; in its own process it runs, side by side with another reward."""
    rewards = _bind({"name": f"{rewards_module}:accuracy_reward"}, {"name": f"{rewards_module}:where"})
    try:
        assert all(r.process is not None for r in rewards)
        values, report = call_rewards(rewards, _inputs([r"The answer is $\frac{1}{2}$", "$0.7$"]))
        assert values[f"{rewards_module}:accuracy_reward"] == [1.0, 0.0]
        assert values[f"{rewards_module}:where"] == [1.0, 1.0]
        assert sys.modules[rewards_module].CALLS == []  # it ran elsewhere, not in this process
        assert set(report.seconds) == {r.name for r in rewards}
    finally:
        close_rewards(rewards)


def test_a_reward_file_named_by_its_path_runs_in_its_process_and_in_the_trainer(tmp_path, monkeypatch):
    """`path/to/file.py:function`, relative or absolute, not on sys.path: the worker process
    loads the file by the same path; the file imports a module beside it, as a script would."""
    folder = tmp_path / "my rewards"
    folder.mkdir()
    (folder / "rewards.py").write_text(textwrap.dedent(REWARDS) + "\nfrom helper_beside import HALF\n")
    (folder / "helper_beside.py").write_text("HALF = 0.5\n")
    monkeypatch.setenv("TEST_PID", str(os.getpid()))
    monkeypatch.chdir(tmp_path)
    absolute = f"{folder / 'rewards.py'}:where"
    rewards = _bind({"name": "./my rewards/rewards.py:accuracy_reward"}, {"name": absolute})
    (local,) = _bind({"name": absolute, "process": False})
    try:
        assert all(r.process is not None for r in rewards)
        values, _ = call_rewards(rewards, _inputs([r"The answer is $\frac{1}{2}$", "$0.7$"]))
        assert values["./my rewards/rewards.py:accuracy_reward"] == [1.0, 0.0]
        assert values[absolute] == [1.0, 1.0]  # its own process's main thread
        assert call_rewards([local], _inputs(["a"]))[0][absolute] == [0.0]  # a thread of this process
    finally:
        close_rewards(rewards)
    with pytest.raises(KeyError, match=r"could not be imported: no file .*missing\.py \(a path to a \.py file\)"):
        _bind({"name": "./missing.py:where"})


def test_a_reward_class_is_instantiated_once_and_gets_trainer_state(rewards_module):
    (counter,) = _bind({"name": f"{rewards_module}:Counter"})
    try:
        first = call_rewards([counter], _inputs(["a"], step=3))[0][counter.name]
        second = call_rewards([counter], _inputs(["a", "b"], step=4))[0][counter.name]
        assert first == [1.03] and second == [2.04, 2.04]
    finally:
        close_rewards([counter])


def test_process_false_keeps_a_reward_on_the_trainers_threads(rewards_module):
    (where,) = _bind({"name": f"{rewards_module}:where", "process": False})
    assert where.process is None
    assert call_rewards([where], _inputs(["a"]))[0][where.name] == [0.0]  # a thread of this process
    assert sys.modules[rewards_module].CALLS == [1]


def test_async_rewards_and_builtins_stay_in_the_trainer(rewards_module):
    awaited, accuracy = _bind({"name": f"{rewards_module}:awaited"}, {"name": "accuracy"})
    assert awaited.process is None and accuracy.process is None
    (in_process,) = _bind({"name": "accuracy", "process": True})
    try:
        assert in_process.process is not None
        assert call_rewards([in_process], _inputs(["0.5"]))[0]["accuracy"] == [1.0]  # built-ins get strings
    finally:
        close_rewards([in_process])


def test_a_call_past_its_timeout_is_killed_and_the_next_call_gets_a_fresh_process(rewards_module, tmp_path):
    (sleeps,) = _bind({"name": f"{rewards_module}:sleeps", "timeout_s": 3})
    try:
        values, report = call_rewards([sleeps], _inputs(["a", "b"]))
        assert values[sleeps.name] == [None, None] and report.timeouts == {sleeps.name: 1}
        first = sleeps.process._proc
        assert first.wait(timeout=60) == -9  # killed, not left running
        values, report = call_rewards([sleeps], _inputs(["a"]))
        assert values[sleeps.name] == [0.5] and report.timeouts == {}
        assert sleeps.process._proc is not first
    finally:
        close_rewards([sleeps])


@pytest.mark.parametrize(
    "fn, message",
    [
        ("exits", r"raised SystemExit: giving up (?s:.*)line \d+, in exits"),
        ("dies", "failed: its process ended with exit code 7 during the call"),
        ("not_a_list", "returned float, expected a list of floats"),
    ],
)
def test_every_way_a_reward_process_fails_is_named(rewards_module, fn, message):
    (bad,) = _bind({"name": f"{rewards_module}:{fn}"})
    try:
        with pytest.raises(RewardError, match=f"reward '{rewards_module}:{fn}' .*{message}"):
            call_rewards([bad], _inputs(["a"]))
    finally:
        close_rewards([bad])


def test_closing_ends_the_process(rewards_module):
    (where,) = _bind({"name": f"{rewards_module}:where"})
    call_rewards([where], _inputs(["a"]))
    proc = where.process._proc
    close_rewards([where])
    assert proc.wait(timeout=30) == 0


def test_check_refuses_a_process_for_a_reward_that_cannot_have_one():
    cfg = Config.model_validate({"rewards": [{"name": "code_pass", "process": True}]})
    assert any("set process: false" in p for p in check_rewards(cfg, None))
