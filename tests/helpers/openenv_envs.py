"""OpenEnv environments (openenv-core's Environment, Action, Observation) for tests of `type: openenv`,
and `app`, their server: `PLAIT_TEST_OPENENV=GuessEnv PLAIT_TEST_OPENENV_SESSIONS=4 uvicorn openenv_envs:app`."""

from __future__ import annotations

import os
import random
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """Guess the hidden number."""

    guess: int = Field(description="The number you guess, 1 to 9.")


class GuessObservation(Observation):
    message: str = ""


class GuessEnv(Environment):
    """Find the hidden number (the row's `target`, else one drawn from the seed): each wrong guess
    costs 0.25 and is told 'higher' or 'lower'; the right one earns 1 and ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, target=None, **kwargs) -> GuessObservation:
        self.target = int(target) if target is not None else random.Random(seed).randint(1, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=" Guess the number from 1 to 9 with the step tool.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == 13:
            raise ValueError("13 is not a number this game takes")
        if action.guess == 0:  # a step that never answers in time
            time.sleep(30)
        if action.guess == self.target:
            return GuessObservation(message="right", reward=1.0, done=True)
        return GuessObservation(message="higher" if action.guess < self.target else "lower", reward=-0.25)

    @property
    def state(self) -> State:
        return self._state


class BrokenResetEnv(GuessEnv):
    """An environment whose reset works once per row (when plait builds the row's prompt) and then
    fails: its rollouts can't start."""

    seen: set = set()

    def reset(self, seed=None, episode_id=None, prompt=None, **kwargs) -> GuessObservation:
        if prompt in BrokenResetEnv.seen:
            raise ConnectionError("the game's database is down")
        BrokenResetEnv.seen.add(prompt)
        return super().reset(seed, episode_id, **kwargs)


ENVS = {"GuessEnv": GuessEnv, "BrokenResetEnv": BrokenResetEnv}

app = create_app(
    ENVS[os.environ.get("PLAIT_TEST_OPENENV", "GuessEnv")],
    GuessAction,
    GuessObservation,
    max_concurrent_envs=int(os.environ.get("PLAIT_TEST_OPENENV_SESSIONS", "8")),
)
