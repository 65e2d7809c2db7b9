"""Rollout programs (plait/programs): one is chosen per run from its config, and a program of
your own (`rollout.program: module:factory`) is one file: the example docs/environments.md shows
(examples/retry_program.py) samples through plait's engine, adds its hint out of the loss, and a
real run trains through it, synchronously and asynchronously."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_rollout_func import engine_and_prompts, two_rounds  # noqa: F401 - the fixture: the tiny model's engine, two prompts
from test_train import tiny_overrides

from examples.retry_program import HINT
from plait.config import load_config
from plait.config.checks import check_user_loops, probe
from plait.programs import PROGRAMS, ProgramSetup, make_program, program_kind
from plait.types import SamplingParams


ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples.retry_program:RetryUnboxed"


def test_the_docs_show_the_example_that_is_tested():
    code = (ROOT / "examples" / "retry_program.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "environments.md").read_text(), re.S)
    body = code[code.index("from dataclasses") :]  # the file less its docstring
    assert any(block == body for block in blocks), "docs/environments.md must show examples/retry_program.py as is"
    assert len(body.splitlines()) <= 32


def test_each_config_section_chooses_one_registered_program(tiny_model_path, prompts_jsonl):
    def kind(*extra):
        return program_kind(load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, "/unused", *extra)))

    assert kind() == "single"
    assert kind("rollout.tools={format: hermes, python: true}") == "tools"
    assert kind("rollout.rollout_func=rollout_funcs:two_turns") == "rollout_func"
    assert kind("rollout.agent={function: 'agents:one_call'}") == "agent"
    assert kind(f"rollout.program={EXAMPLE}") == EXAMPLE
    assert {"single", "tools", "rollout_func", "agent"} <= set(PROGRAMS)


def test_config_mistakes_are_refused_before_a_model_loads(tiny_model_path, prompts_jsonl):
    def problems(*extra):
        cfg = load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, "/unused", *extra))
        return check_user_loops(cfg, probe(cfg, 1))

    assert problems(f"rollout.program={EXAMPLE}") == []
    assert any("no function 'Nowhere'" in p for p in problems("rollout.program=examples.retry_program:Nowhere"))
    both = problems(f"rollout.program={EXAMPLE}", "rollout.rollout_func=rollout_funcs:two_turns")
    assert any("plait's tool loop can't run beside it" in p for p in both)


def test_the_example_retries_an_unboxed_answer_after_a_hint_left_out_of_the_loss(engine_and_prompts):  # noqa: F811
    cfg, tok, engine, prompts = engine_and_prompts
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.program = EXAMPLE
    program = make_program(ProgramSetup(cfg, tok))
    params = SamplingParams(max_tokens=30, seed=5, stop=[" "])  # short answers: room for a retry
    out = program.run(engine, prompts, params, 2)
    plain = engine.generate(prompts, params, n=2)  # the first answers, without the program
    hint = tok(HINT, add_special_tokens=False)["input_ids"]
    retried = 0
    for row, plain_row in zip(out, plain):
        for c, p in zip(row, plain_row):
            first = len(p.token_ids)
            assert c.token_ids[:first] == p.token_ids and c.logprobs[:first] == p.logprobs
            assert len(c.token_ids) <= params.max_tokens
            if len(c.token_ids) == first:  # boxed, or no room for a retry: the answer as sampled
                assert c.sampled_mask is None
                continue
            retried += 1
            second = len(c.token_ids) - first - len(hint)
            assert c.token_ids[first : first + len(hint)] == hint and second > 0
            assert c.sampled_mask == [1] * first + [0] * len(hint) + [1] * second
            assert c.logprobs[first : first + len(hint)] == [0.0] * len(hint)
            assert "boxed" not in c.model_text and c.model_text.startswith(p.text)  # rewards never read the hint
    assert retried > 0  # the untrained tiny model does not box: its answers are retried


@pytest.mark.parametrize(
    "staleness, teacher", [(0, False), (1, False), (0, True)], ids=["sync", "async", "sync with a teacher"]
)
def test_a_run_trains_through_a_program_of_your_own(
    tiny_model_path, teacher_model_path, prompts_jsonl, tmp_path, staleness, teacher
):
    """Synchronous, and asynchronous (k = 1: the program runs in rank 0's producer thread, its
    samples come from the generation process); and with a distillation teacher, which scores the
    joined trajectories (the hints are context to it, out of its advantage as out of the loss)."""
    run = tmp_path / "run"
    short = "rollout.stop=[' ']"  # short answers: room for a retry
    every = "log.sample_every_steps=1"
    extra = [f"teacher.name_or_path={teacher_model_path}"] if teacher else []
    result = two_rounds(
        tiny_model_path, prompts_jsonl, run, staleness, f"rollout.program={EXAMPLE}", short, every, *extra
    )
    if teacher:
        assert all(m["teacher/kl"] != 0 and m["update/signal_share"] == 1.0 for m in result.history)
    assert len(result.history) == 2
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert any(HINT.strip() in s["completion"] for s in samples)  # retried rollouts were trained on
    # the hints' log-probs are 0, not the engine's: a gap this small means they were left out of it
    same_weights = result.history if staleness == 0 else result.history[:1]
    assert all(m["logprob_gap"] < 1e-4 for m in same_weights)
