"""A reasoning-gym mixture trains end to end on a tiny model: per-environment metrics and
evaluation, the environment's verifier as the reward, and an exact resume."""

import json

import pytest
from test_train import assert_resumed_exactly, crash_then_resume, tiny_overrides

from plait.config import load_config
from plait.train.loop import train


pytestmark = pytest.mark.slow
pytest.importorskip("reasoning_gym")

MIXTURE = (
    "environments=["
    "{type: reasoning_gym, dataset: basic_arithmetic, config: {min_terms: 2, max_terms: 2, max_digits: 1}, "
    "size: 40, eval_size: 6},"
    "{type: reasoning_gym, dataset: leg_counting, name: legs, config: {min_animals: 1, max_animals: 2}, "
    "size: 40, eval_size: 6, answer_format: boxed}]"
)
# the test's prompt files off: the environments give the prompts
OFF = ["data.path=null", "data.eval_path=null", MIXTURE]
SCORED = "rewards=[{name: environment}, {name: 'plait_test_rewards:vowel_share'}]"


def _train(model, data, out, *extra):
    """2 rounds on `extra`'s environments (the test's prompt files off)."""
    return train(
        load_config(
            None, tiny_overrides(model, data, out, "data.path=null", "data.eval_path=null", "train.max_steps=2", *extra)
        )
    )


def test_a_mixture_trains_with_metrics_and_evaluation_per_environment(tiny_model_path, prompts_jsonl, tmp_path):
    result = _train(
        tiny_model_path, prompts_jsonl, tmp_path / "run", MIXTURE, SCORED, "eval.before=true", "eval.after=true"
    )
    completions = 0
    for m in result.history:
        assert m["reward/environment/mean"] == m["reward/environment/mean"]  # scored, not NaN
        for label in ("basic_arithmetic", "legs"):
            assert m.get(f"env/{label}/errors", 0.0) == 0.0
        completions += sum(m.get(f"env/{label}/completions", 0) for label in ("basic_arithmetic", "legs"))
    assert completions == 2 * 2 * 4  # every completion of both rounds belongs to one environment
    records = [json.loads(line) for line in (result.run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["tag"] for r in records] == ["before", "after"]
    for r in records:
        assert {"environment", "env/basic_arithmetic", "env/legs"} <= set(r) and r["n"] > 6
    from plait.report import write_report

    page = write_report(result.run_dir)
    assert (page.parent / "figures" / "environments.png").is_file() and "Environments" in page.read_text()


def test_resume_through_an_environment_is_exact(tiny_model_path, prompts_jsonl, tmp_path):
    straight, crashed, result = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path, *OFF)
    assert len(result.history) == 2
    assert_resumed_exactly(straight, crashed)  # the same problems and tokens every round, the resumed ones too


def test_an_asynchronous_run_scores_with_the_environment(tiny_model_path, prompts_jsonl, tmp_path):
    """Generated in the HF engine's own process a round ahead: the rows' columns travel with
    the prompts, and the verifier scores in the trainer's process."""
    history = _train(
        tiny_model_path, prompts_jsonl, tmp_path / "run", MIXTURE, SCORED, "rollout.max_staleness=1"
    ).history
    assert len(history) == 2
    assert all(sum(m.get(f"env/{e}/completions", 0) for e in ("basic_arithmetic", "legs")) == 8 for m in history)


def _broken_verifier(monkeypatch):
    """basic_arithmetic's verifier raises on any answer but the reference, as a buggy
    environment would that still passes `plait check` (fault injection)."""
    from reasoning_gym.arithmetic.basic_arithmetic import BasicArithmeticDataset

    right = BasicArithmeticDataset.score_answer

    def score_answer(self, answer, entry):
        if answer != entry["answer"]:
            raise RuntimeError("the verifier crashed")
        return right(self, answer, entry)

    monkeypatch.setattr(BasicArithmeticDataset, "score_answer", score_answer)


def test_verifier_failures_are_left_out_and_counted_below_the_limit(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch
):
    _broken_verifier(monkeypatch)
    mixture = MIXTURE.replace("size: 40, eval_size: 6},", "size: 40, eval_size: 6, max_error_share: 1.0},", 1)
    # the tiny model never writes the asked format: its last words go to the verifier
    credit = (
        "rewards=[{name: environment, kwargs: {unformatted_credit: 0.5}}, {name: 'plait_test_rewards:vowel_share'}]"
    )
    history = _train(tiny_model_path, prompts_jsonl, tmp_path / "run", mixture, credit).history
    for m in history:
        assert m.get("env/basic_arithmetic/errors", 0) == m.get("env/basic_arithmetic/completions", 0)
        assert m.get("env/legs/errors", 0) == 0
    assert sum(m.get("env/basic_arithmetic/errors", 0) for m in history) > 0


def test_a_verifier_failing_past_its_limit_stops_the_run_with_its_message(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch, capsys
):
    from plait.cli import main

    _broken_verifier(monkeypatch)
    out = tmp_path / "run"
    env = "{type: reasoning_gym, dataset: basic_arithmetic, size: 20, eval_size: 4}"
    opts = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        out,
        "data.path=null",
        "data.eval_path=null",
        f"environments=[{env}]",
        "rewards=[{name: environment, kwargs: {unformatted_credit: 0.5}}]",
        "checkpoint.save_steps=1",
    )
    assert main(["train", *sum((["--set", o] for o in opts), [])]) == 2
    err = capsys.readouterr().err
    assert "environment 'basic_arithmetic' failed to score 8 of its 8 completions in round 1" in err
    assert "RuntimeError: the verifier crashed" in err and "resume=auto" in err


def test_a_verifier_failure_leaves_the_completion_unscored_by_every_reward(monkeypatch):
    """A completion its environment's verifier failed on is an infrastructure error: shaping
    rewards beside `environment` do not score it either, so it stays out of its group's
    statistics instead of being judged by format alone. A wrong answer the verifier judged
    keeps every score: the planted verifier raises on two answers only and judges the other
    answers as the dataset's own verifier does (a wrong one 0)."""
    from reasoning_gym.arithmetic.basic_arithmetic import BasicArithmeticDataset

    from plait.config.schema import ReasoningGymEnvironment, RewardSpec
    from plait.programs import reasoning_gym
    from plait.rewards.runner import bind_rewards, score_groups
    from plait.types import Completion, Group, Prompt

    crashes_on, judged, own = {"-123456", "31337"}, [], BasicArithmeticDataset.score_answer

    def score_answer(self, answer, entry):
        if answer in crashes_on:
            raise RuntimeError("the verifier crashed")
        judged.append((answer, own(self, answer, entry)))
        return judged[-1][1]

    monkeypatch.setattr(BasicArithmeticDataset, "score_answer", score_answer)
    spec = ReasoningGymEnvironment(
        type="reasoning_gym", dataset="basic_arithmetic", size=4, eval_size=1, answer_format="boxed"
    )
    row = reasoning_gym.rows(spec, "basic_arithmetic", "train", 0, 4)[0]
    prompt = Prompt(0, row["prompt"], [1], row["answer"], {k: row[k] for k in ("environment", "env_source")})
    wrong = str(int(row["answer"]) + 1)
    texts = [
        f"\\boxed{{{row['answer']}}}",  # right
        "\\boxed{-123456}",  # the verifier crashes
        f"\\boxed{{{wrong}}}",  # wrong, in the asked format: judged 0
        "\\boxed{31337}",  # the verifier crashes
        "no answer at all",  # nothing in the asked format: 0 without the verifier
    ]
    group = Group(prompt, [Completion(0, [1], t, [0.0], False, "eos") for t in texts])
    score_groups([group], bind_rewards([RewardSpec(name="environment"), RewardSpec(name="boxed_format")]))
    assert judged == [(row["answer"], 1.0), (wrong, 0.0)]  # the verifier judged these two, and only these
    assert group.rewards["environment"] == [1.0, None, 0.0, None, 0.0]  # a crash is None, not a wrong answer
    # format scores what the verifier judged, the wrong answer included, and nothing it crashed on
    assert group.rewards["boxed_format"] == [1.0, None, 1.0, None, 0.0]
