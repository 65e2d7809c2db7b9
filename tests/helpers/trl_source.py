"""TRL's own source text, read without importing TRL (which imports vLLM), so tests can run
the very lines TRL ships against plait's functions."""

import importlib.util
from pathlib import Path

import pytest


def trl_source(module: str) -> str:
    """The text of TRL's `module` (a path below the package, e.g. "trainer/grpo_trainer")."""
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("needs the bench extra (trl)")
    return (Path(spec.submodule_search_locations[0]) / f"{module}.py").read_text()
