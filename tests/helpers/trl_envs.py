"""Environment classes in TRL's `environment_factory` form, for tests of `type: trl_env`.

Standard library only: the sandboxed (replayed) runs execute this module's source."""

from __future__ import annotations


class CounterEnv:
    """Reach the row's target by adding numbers to a running total."""

    def reset(self, **kwargs) -> str:
        self.target = int(kwargs.get("target", 7))
        self.total = 0
        return f" Reach {self.target} with the add tool."

    def add(self, n: int) -> int:
        """Add a number to the running total.

        Args:
            n: The number to add.

        Returns:
            The new total.
        """
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0

    def _helper(self) -> None:  # private: not a tool
        pass


class EchoEnv:
    """Say a word back; no reward of its own (the config names rewards)."""

    def reset(self, **kwargs) -> None:
        self.said = []

    def echo(self, word: str) -> str:
        """Echo a word.

        Args:
            word: The word.

        Returns:
            The same word, in capitals.
        """
        self.said.append(word)
        return word.upper()


class MoodyEnv(CounterEnv):
    """Shows a different text on each reset: the rollouts of one prompt would differ."""

    count = 0

    def reset(self, **kwargs) -> str:
        super().reset(**kwargs)
        MoodyEnv.count += 1
        return f" Attempt {MoodyEnv.count}."


class BrokenRewardEnv(CounterEnv):
    """Its get_reward fails: an infrastructure error, not a score."""

    def get_reward(self) -> float:
        raise RuntimeError("the scorer is down")
