"""Code rewards through the real sandbox, the reward runner's async/parallel/timeout rules,
and two-stage generation in a real training run on a tiny model."""

import json
import threading

import plait_test_rewards
import pytest

from plait.config import load_config
from plait.data.tasks import humaneval, humaneval_capacity
from plait.rewards.code import code_pass, code_tests_passed
from plait.rewards.runner import BoundReward, RewardError, score_groups
from plait.sandbox import Limits
from plait.sandbox.box import Sandbox, SandboxSettings
from plait.train.loop import train
from plait.types import Completion, Group, Prompt


def _columns(rows):
    return {k: [r[k] for r in rows] for k in ("tests", "setup", "code_prefix", "entry_point")}


def test_every_humaneval_canonical_solution_scores_one():
    """The check that the sandbox scores correct code 1.0: all 164 problems."""
    rows = humaneval("train", humaneval_capacity("train")) + humaneval("eval", humaneval_capacity("eval"))
    box = Sandbox()
    scores = code_pass([r["canonical_solution"] for r in rows], **_columns(rows), sandbox=box)
    assert scores == [1.0] * 164
    stats = box.counts()
    assert stats["invalid"] == 0 and stats["executions"] + stats["cached"] == 164


def test_wrong_partial_and_hostile_code_scores():
    row = humaneval("eval", 1)[0]
    n = len(row["tests"])
    completions = [
        "```python\n" + row["code_prefix"] + row["canonical_solution"] + "```",  # restated in full: passes
        "    return None\n",  # wrong
        "import sys\nsys.exit(0)\n",  # exits before the asserts
        'print("PASSED")\n',  # claims success on stdout
    ]
    cols = {k: v * len(completions) for k, v in _columns([row]).items()}
    assert code_pass(completions, **cols) == [1.0, 0.0, 0.0, 0.0]
    fractions = code_tests_passed(completions, **cols)
    assert fractions[0] == 1.0 and all(0.0 <= f < 1.0 for f in fractions[1:]) and n > 1


def test_fraction_counts_each_test():
    tests = [["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7", "assert f(0) == 0"]]
    assert code_tests_passed(["def f(x):\n    return 2 * x\n"], tests=tests) == [0.75]
    assert code_pass(["def f(x):\n    return 2 * x\n"], tests=tests) == [0.0]
    assert code_pass(["anything"], tests=[None]) == [None]  # a row without tests: not applicable


def test_sandbox_failure_is_excluded_not_scored_wrong():
    box = Sandbox(SandboxSettings(Limits(), "process", 1, "/nonexistent/python3"))
    assert code_pass(["def f():\n    return 1\n"], tests=[["assert f() == 1"]], sandbox=box) == [None]
    assert box.counts()["invalid"] == 1


def _groups(n_prompts=2, n=3):
    return [
        Group(
            Prompt(i, f"p{i}", [1, 2]),
            [
                Completion(i, [1] * (j + 1), f"text {i} {j} aeiou"[: 6 + j], [0.0] * (j + 1), False, "eos")
                for j in range(n)
            ],
        )
        for i in range(n_prompts)
    ]


def test_async_rewards_and_parallel_calls():
    barrier = threading.Barrier(2, timeout=20)

    def waits_for_the_other(completions, **_):
        barrier.wait()  # fails (BrokenBarrierError) unless both rewards run at the same time
        return [1.0] * len(completions)

    groups = _groups()
    rewards = [
        BoundReward("a", waits_for_the_other, timeout_s=60),
        BoundReward("b", waits_for_the_other, timeout_s=60),
        BoundReward("async", plait_test_rewards.async_vowel_share, timeout_s=60),
    ]
    score_groups(groups, rewards)
    assert groups[0].rewards["a"] == [1.0] * 3
    assert groups[0].rewards["async"] == plait_test_rewards.vowel_share([c.text for c in groups[0].completions])


def test_a_reward_past_its_time_limit_is_excluded_with_a_count():
    release = threading.Event()

    def hangs(completions, **_):
        release.wait(30)
        return [1.0] * len(completions)

    groups = _groups()
    try:
        report = score_groups(
            groups,
            [
                BoundReward("hangs", hangs, timeout_s=0.5),
                BoundReward("ok", lambda completions, **_: [0.5] * len(completions), timeout_s=60),
            ],
        )
    finally:
        release.set()
    assert groups[0].rewards["hangs"] == [None] * 3 and groups[0].rewards["ok"] == [0.5] * 3
    assert groups[0].total == [0.5] * 3  # the None adds nothing
    assert report.timeouts["hangs"] == 1


def test_async_reward_errors_are_still_reward_errors():
    async def broken(completions, **_):
        raise ValueError("judge down")

    with pytest.raises(RewardError, match="judge down"):
        score_groups(_groups(), [BoundReward("broken", broken, timeout_s=10)])


def _tiny(model, data, out, *extra):
    train_f, eval_f = data
    return [
        f"model.name_or_path={model}",
        "data.task=null",
        f"data.path={train_f}",
        f"data.eval_path={eval_f}",
        "data.prompt_field=question",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=8",
        "train.micro_batch_size=4",
        "train.max_steps=2",
        "train.precision=fp32",
        "eval.before=false",
        "eval.after=false",
        "log.console=none",
        f"output_dir={out}",
        *extra,
    ]


def test_two_stage_spends_the_rest_of_the_group_only_where_it_can_teach(tiny_model_path, prompts_jsonl, tmp_path):
    """even_a scores a whole group 1 (a even) or 0: with not_all_correct, prompts with even a
    stop after 2 candidates; the kept groups are all odd-a, full size."""
    cfg = load_config(
        None,
        _tiny(
            tiny_model_path,
            prompts_jsonl,
            tmp_path / "run",
            "rewards=[{name: 'plait_test_rewards:even_a'}, {name: 'plait_test_rewards:vowel_share', weight: 0.1}]",
            "rollout.two_stage={first_generations: 2, keep: not_all_correct}",
            "algo.max_sampling_rounds=4",
        ),
    )
    res = train(cfg)
    for m in res.history:
        assert m["sampling/rounds"] >= 1
        skipped = m.get("two_stage/prompts_skipped", 0.0)
        assert m.get("two_stage/generations_saved", 0.0) == skipped * 2
        assert m["reward/plait_test_rewards:even_a/mean"] == 0.0  # only odd-a prompts were kept
    assert sum(m.get("two_stage/prompts_skipped", 0.0) for m in res.history) > 0


def test_two_stage_fills_up_with_skipped_prompts_when_too_few_pass(tiny_model_path, prompts_jsonl, tmp_path):
    from plait.data import build_prompts, load_rows
    from plait.models import load_model, load_tokenizer
    from plait.programs import Single
    from plait.rewards.runner import bind_rewards
    from plait.rollout import make_engine
    from plait.telemetry import PhaseTimer
    from plait.train.sampling import Sampler

    cfg = load_config(
        None,
        _tiny(
            tiny_model_path,
            prompts_jsonl,
            tmp_path / "run",
            "rewards=[{name: 'plait_test_rewards:even_a'}]",
            "rollout.two_stage={first_generations: 1, keep: not_all_failed}",
            "algo.max_sampling_rounds=1",
        ),
    )
    tok = load_tokenizer(str(tiny_model_path))
    prompts = build_prompts(load_rows(cfg.data, "train", 0), tok, cfg.data)
    odd = [p for p in prompts if p.columns["a"] % 2 == 1][:3]  # every one fails the rule
    engine = make_engine(cfg, load_model(str(tiny_model_path)), tok)
    sampler = Sampler(engine, Single(), cfg, bind_rewards(cfg.rewards), PhaseTimer())
    groups, stats = sampler.collect(lambda k: odd[:k], 3, 1)
    assert [len(g.completions) for g in groups] == [4, 4, 4]  # completed to full size
    assert stats.prompts_skipped == 0 and stats.generations_saved == 0


def test_code_task_trains_end_to_end_in_the_sandbox(tiny_model_path, tmp_path):
    """A user JSONL code task: prompts with tests, code_tests_passed reward, two-stage."""
    rows = [
        {"prompt": f"Write f(x) returning x + {k}.", "tests": [f"assert f(1) == {1 + k}", f"assert f(2) == {2 + k}"]}
        for k in range(8)
    ]
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_model_path}",
            "data.task=null",
            f"data.path={data}",
            "data.answer_field=null",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=3",
            "rollout.max_completion_length=8",
            "train.micro_batch_size=3",
            "train.max_steps=2",
            "train.precision=fp32",
            "rewards=[{name: code_tests_passed}, {name: plait_test_rewards:vowel_share, weight: 0.1}]",
            "rollout.two_stage={first_generations: 1, keep: not_all_correct, reward: code_tests_passed}",
            "eval.before=false",
            "eval.after=false",
            "log.console=none",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    res = train(cfg)
    m = res.history[0]
    assert m["sandbox/executions"] + m["sandbox/cached"] >= 6 and m["sandbox/invalid"] == 0
    assert m["reward/code_tests_passed/mean"] == 0.0  # a random model writes no working code
