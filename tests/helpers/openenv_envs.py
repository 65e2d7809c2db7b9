"""OpenEnv environments (openenv-core's Environment, Action, Observation) for tests of `type: openenv`,
and `app`, their server: `PLAIT_TEST_OPENENV=GuessEnv PLAIT_TEST_OPENENV_SESSIONS=4 uvicorn openenv_envs:app`."""

from __future__ import annotations

import os
import random
import time

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
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
    """An environment whose reset works once per prompt (when plait builds it) and then fails:
    its rollouts can't start."""

    seen: set = set()

    def reset(self, seed=None, episode_id=None, prompt=None, **kwargs) -> GuessObservation:
        if prompt in BrokenResetEnv.seen:
            raise ConnectionError("the game's database is down")
        BrokenResetEnv.seen.add(prompt)
        return super().reset(seed, episode_id, **kwargs)


class GuessToolsEnv(MCPEnvironment):
    """GuessEnv's game through MCP tools (OpenEnv's RFC 003): `guess(n)` and `hint()`; the reward
    rides on the observation of the call that found the number."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("guess")
        self.target, self.found = 5, False

        @mcp.tool
        def guess(n: int) -> str:
            """Guess the hidden number.

            Args:
                n: The number you guess, 1 to 9.
            """
            if n == 13:
                raise ValueError("13 is not a number this game takes")
            self.found = n == self.target
            return "right" if self.found else "higher" if n < self.target else "lower"

        @mcp.tool
        def hint() -> str:
            """Whether the hidden number is even."""
            return "even" if self.target % 2 == 0 else "odd"

        super().__init__(mcp)

    def reset(self, seed=None, episode_id=None, target=None, **kwargs) -> Observation:
        self.target = int(target) if target is not None else random.Random(seed).randint(1, 9)
        self.found = False
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=" Find the number from 1 to 9 with the guess and hint tools.")

    def step(self, action, timeout_s=None, **kwargs) -> Observation:
        return self._rewarded(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action, timeout_s=None, **kwargs) -> Observation:  # what the server calls
        return self._rewarded(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _rewarded(self, action, obs: Observation) -> Observation:
        if isinstance(action, CallToolAction) and action.tool_name == "guess" and obs.error is None:
            obs.reward, obs.done = (1.0, True) if self.found else (-0.25, False)
        return obs

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        raise ValueError(f"{type(action).__name__}: this environment acts only through its tools")

    @property
    def state(self) -> State:
        return self._state


class DownEnv(GuessEnv):
    """An environment whose reset always fails."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        raise ConnectionError("the game's database is down")


ENVS = {"GuessEnv": GuessEnv, "BrokenResetEnv": BrokenResetEnv, "GuessToolsEnv": GuessToolsEnv}
_served = ENVS[os.environ.get("PLAIT_TEST_OPENENV", "GuessEnv")]
app = create_app(
    _served,
    CallToolAction if _served is GuessToolsEnv else GuessAction,
    GuessObservation,
    max_concurrent_envs=int(os.environ.get("PLAIT_TEST_OPENENV_SESSIONS", "8")),
)
