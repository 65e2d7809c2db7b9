"""The learning-health notes at the end of a run and in the report: each fires on the curve it
describes, and a healthy run gets none."""

from plait.config import load_config
from plait.telemetry.advice import health_notes


CFG = load_config(None, ["train.learning_rate=3e-5"])


def rounds(**series):
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(n)]


def test_a_healthy_run_gets_no_notes():
    rising = [0.1 * i for i in range(12)]
    history = rounds(reward__total__mean=rising, entropy=[1.0] * 12, clip__fraction=[0.05] * 12, grad_norm=[1.0] * 12)
    evals = [{"step": 0, "accuracy": 0.1}, {"step": 12, "accuracy": 0.5}]
    assert health_notes(history, evals, CFG, "accuracy") == []
    assert health_notes(history[:3], [], CFG, "accuracy") == []  # too short to say anything


def test_each_note_fires_on_its_curve():
    peak_then_collapse = [0.0, 0.2, 0.5, 0.7, 0.72, 0.7, 0.5, 0.3, 0.1, 0.06, 0.06, 0.06]
    history = rounds(
        reward__total__mean=peak_then_collapse,
        entropy=[1.0] * 4 + [0.5] * 4 + [0.1] * 4,
        clip__fraction=[0.05] * 4 + [0.2] * 4 + [0.4] * 4,
        grad_norm=[1.0] * 4 + [2.0] * 4 + [5.0] * 4,
    )
    evals = [{"step": 0, "accuracy": 0.1}, {"step": 5, "accuracy": 0.6}, {"step": 12, "accuracy": 0.2}]
    text = "\n".join(health_notes(history, evals, CFG, "accuracy"))
    assert "the reward fell from its peak" in text and "train.learning_rate (now 3e-05)" in text
    assert "the evaluation (accuracy) peaked at 0.600 (round 5) and ended at 0.200" in text
    assert "entropy collapsed (1.000 -> 0.100" in text and "Try clip-higher" in text  # tokens were clipped
    assert "clipped share of tokens climbed (0.05 -> 0.40)" in text
    assert "gradient norm climbed (1 -> 5" in text


def test_an_entropy_collapse_without_clipping_is_not_sent_to_clip_higher():
    """One update a round starts on-policy: the ratio is 1, nothing is clipped, and clip-higher
    would change nothing (the demo's runs: clip fraction 0.000 in every round)."""
    history = rounds(entropy=[2.0] * 4 + [0.8] * 4 + [0.1] * 4, clip__fraction=[0.0] * 12)
    (note,) = health_notes(history, [], CFG, "accuracy")
    assert "entropy collapsed (2.000 -> 0.100" in note and "entropy bonus (algo.entropy_coeff)" in note
    assert "not clip-higher: no token was clipped" in note and "Try clip-higher" not in note


def test_a_run_that_converged_is_not_told_to_fight_its_entropy():
    """The reward rose to its best and stayed (a solved task: tools-multiply, 1.7 on nearly every
    completion in its last rounds): falling entropy and equal groups are convergence, and the notes
    say so instead of sending the user to an entropy bonus. The same curves with a reward that fell
    back keep the old advice."""
    solved = [0.2, 0.4, 1.0, 1.3, 1.4, 1.6] + [1.7] * 6
    history = rounds(
        reward__total__mean=solved,
        reward__total__max=[1.7] * 12,
        entropy=[0.5] * 4 + [0.1] * 4 + [0.02] * 4,
        groups__all_equal=[0.1] * 4 + [0.6] * 4 + [1.0] * 4,
        groups__all_right=[0.0] * 4 + [0.5] * 4 + [1.0] * 4,
        groups__all_wrong=[0.1] * 4 + [0.1] * 4 + [0.0] * 4,
        clip__fraction=[0.0] * 12,
    )
    text = "\n".join(health_notes(history, [], CFG, "accuracy"))
    assert "as the reward rose to its best and stayed there: the policy converged" in text
    assert "The reward ended near the most a completion earned: the task is solved" in text
    assert "entropy bonus" not in text and "entropy collapsed" not in text
    fell = [{**m, "reward/total/mean": 1.2} if i >= 6 else m for i, m in enumerate(history)]
    text = "\n".join(health_notes(fell, [], CFG, "accuracy"))
    assert "entropy collapsed (0.500 -> 0.020" in text and "entropy bonus (algo.entropy_coeff)" in text
    assert "solved" not in text


def test_a_run_that_rose_short_of_what_a_completion_earns_has_not_converged():
    """Rising and ending at its best is not converging when the reward stopped far below what one
    completion earned (1.7): 0.2 -> 0.8 is a run still learning, or stuck, not a solved task."""
    history = rounds(
        reward__total__mean=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7] + [0.8] * 6,
        reward__total__max=[1.7] * 12,
        entropy=[0.5] * 4 + [0.1] * 4 + [0.02] * 4,
        clip__fraction=[0.0] * 12,
    )
    text = "\n".join(health_notes(history, [], CFG, "accuracy"))
    assert "entropy collapsed (0.500 -> 0.020" in text and "converged" not in text


DATA = __import__("pathlib").Path(__file__).parents[1] / "data"


def test_a_recorded_format_takeover_is_named_with_its_knob():
    """A real collapse: the demo's old recipe (accuracy 1.0 + boxed_format 0.5) at seed 1 on a
    2-core Intel Xeon (AMX) learned to answer `a + b = \\boxed{a}`: format reward 0.98, accuracy 0."""
    import json

    history = [json.loads(line) for line in (DATA / "format-takeover-metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, ["rewards=[{name: accuracy, weight: 1.0}, {name: boxed_format, weight: 0.5}]"])
    text = "\n".join(health_notes(history, [], cfg, "boxed_accuracy"))
    assert "reward accuracy fell from its peak" in text and "while boxed_format rose to 0.9" in text
    assert "Lower boxed_format's weight (now 0.5)" in text and "boxed_accuracy instead of boxed_format" in text
    assert "of the groups in the last third of the run had all-equal rewards" in text


def test_a_recorded_collapse_from_a_too_high_learning_rate_is_sent_to_a_lower_one():
    """A real collapse: the demo at seed 0 with 10x its learning rate (3e-4; AMD EPYC Zen 5,
    2026-11-27) peaked in round 2, then looped to the length cap (`88 + 88 = \\boxed{2822}},},},...`):
    every completion cut at 32 tokens from round 10, greedy held-out accuracy 0.04 -> 0.00."""
    import json

    history = [json.loads(line) for line in (DATA / "high-lr-collapse-metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, ["train.learning_rate=3e-4"])
    evals = [{"step": 0, "boxed_accuracy": 0.04}, {"step": 20, "boxed_accuracy": 0.0}]
    notes = health_notes(history, evals, cfg, "boxed_accuracy")
    text = "\n".join(notes)
    assert "the reward fell from its peak" in text and "a lower train.learning_rate (now 0.0003)" in text
    assert "cut at rollout.max_completion_length climbed (1% -> 100%" in text and "degraded: try a lower" in text
    # the demo's own rate on a healthy curve: nothing about truncation
    fine = rounds(reward__total__mean=[0.1 * i for i in range(12)], completion__truncated=[0.05] * 6 + [0.0] * 6)
    assert not any("cut at" in n for n in health_notes(fine, [], CFG, "accuracy"))


def test_the_demo_that_learned_gets_no_learning_note():
    """The demo at seed 0 (make demo from a fresh clone, AMD EPYC Zen 4, 2026-11-28): 0.04 -> 0.45
    held-out, its entropy down from 0.6 to under 0.1 by round 4, as a policy that adds sums right
    should be. A rule that measured entropy from the run's first rounds told it "entropy collapsed
    ... try an entropy bonus"; the thirds' means do not. (reasoning-gym-sums at seed 2 with
    scale_rewards=batch fell the same way and ended at +18: the entropy curve alone can't tell
    the two apart, docs/environments.md.)"""
    import json

    history = [json.loads(line) for line in (DATA / "demo-seed0-zen4-metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, [])
    evals = [{"step": 0, "boxed_accuracy": 0.04}, {"step": 20, "boxed_accuracy": 0.45}]
    assert health_notes(history, evals, cfg, "boxed_accuracy") == []


def test_no_takeover_note_when_both_rewards_rise():
    cfg = load_config(None, ["rewards=[{name: accuracy, weight: 1.0}, {name: boxed_format, weight: 0.5}]"])
    history = rounds(
        reward__accuracy__mean=[0.05 * i for i in range(12)], reward__boxed_format__mean=[0.08 * i for i in range(12)]
    )
    assert not any("at accuracy's expense" in n for n in health_notes(history, [], cfg, "boxed_accuracy"))
    falling = rounds(
        reward__accuracy__mean=[0.1, 0.2, 0.3, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        reward__boxed_format__mean=[0.1 * i for i in range(12)],
    )
    assert any("at accuracy's expense" in n for n in health_notes(falling, [], cfg, "boxed_accuracy"))


def test_a_seed_groups_comparison_names_each_runs_notes(tmp_path):
    """`plait compare` / `plait report` of a seed group: a run's notes, read from its files."""
    import shutil

    from plait.compare import compare, describe

    run = tmp_path / "group" / "seed-1"
    run.mkdir(parents=True)
    shutil.copy(DATA / "format-takeover-metrics.jsonl", run / "metrics.jsonl")
    cfg = load_config(None, ["rewards=[{name: accuracy, weight: 1.0}, {name: boxed_format, weight: 0.5}]"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    summary, page = compare([tmp_path / "group"], tmp_path / "out")
    assert "group/seed-1, learning: reward accuracy fell from its peak" in describe(summary)
    assert "at accuracy&#x27;s expense" in page.read_text()


def test_compare_json_read_back_is_drawn_in_round_order(tmp_path):
    """compare.json's rounds come back as strings; drawn from it, round 10 must still follow 9."""
    import json

    from plait.compare import by_round, figure

    rounds = {str(r): {"mean": r / 20, "min": 0.0, "max": r / 10, "n": 2} for r in range(1, 13)}
    summary = json.loads(json.dumps({"groups": {"a": {"rounds": {"accuracy": rounds}, "curves": {}}}}))
    assert sorted(by_round(summary["groups"]["a"]["rounds"]["accuracy"])) == list(range(1, 13))
    assert figure(summary, "accuracy")[:4] == b"\x89PNG"


def high_lr_collapse() -> list[dict]:
    import json

    return [json.loads(line) for line in (DATA / "high-lr-collapse-metrics.jsonl").read_text().splitlines()]


def test_a_recorded_run_whose_equal_groups_were_all_wrong_is_called_dead_not_solved():
    """The recorded collapse above (the demo at 10x its learning rate): from round 3 every sampled
    answer was wrong, 84% of the last third's groups all-equal. Equal groups read by their value
    (accuracy 0 here) are a dead run. With one good last round added (as a run on a user's task
    once ended, 0.52 after 14 rounds of 0.00-0.25, which the notes then called "converged" and
    "solved"), it still is: one round is not a reward near what a completion earns."""
    cfg = load_config(None, ["train.learning_rate=3e-4"])
    for history in (high_lr_collapse(), [*high_lr_collapse()[:-1], good_last_round(high_lr_collapse()[-1])]):
        text = "\n".join(health_notes(history, [], cfg, "boxed_accuracy"))
        assert "Most are all wrong" in text and "a dead run, not a solved one" in text, text
        assert "converged" not in text and "the task is solved" not in text and "mastered" not in text


def good_last_round(m: dict) -> dict:
    return {**m, "reward/total/mean": 1.1, "reward/boxed_accuracy/mean": 0.52, "reward/accuracy/mean": 0.52}


def test_a_dead_run_with_the_logged_split_and_one_good_last_round_is_not_converged():
    """What a run logs now: the share of groups all right and all wrong, and the most a completion
    earned. Rounds of 0.00-0.25 with the groups all-equal and all wrong, then one round of 0.52."""
    wrong = [0.75, 0.75, 0.875, 0.875, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.875, 1.0, 1.0, 0.375]
    reward = [0.1, 0.25, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.12, 0.0, 0.0, 0.52]
    history = rounds(
        reward__total__mean=reward,
        reward__total__max=[1.0] * 14,
        groups__all_equal=[w + (0.125 if i == 13 else 0.0) for i, w in enumerate(wrong)],
        groups__all_right=[0.0] * 13 + [0.125],
        groups__all_wrong=wrong,
        entropy=[1.69, 1.5, 1.2, 1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.2, 0.15, 0.14, 0.14],
        clip__fraction=[0.0] * 14,
    )
    text = "\n".join(health_notes(history, [], CFG, "accuracy"))
    assert "a dead run, not a solved one" in text and "entropy collapsed" in text
    assert "converged" not in text and "solved (stop" not in text


def test_a_run_not_learning_by_round_4_is_told_so_then():
    """The notes at round 4, not at the end: a run whose groups were all equal and all wrong, or
    whose reward has not risen since round 1 (the recorded 10x learning-rate collapse); the demo's
    recorded run, which learned, gets nothing."""
    import json

    from plait.telemetry.advice import EARLY_ROUND, early_note

    assert EARLY_ROUND == 4
    note = early_note(high_lr_collapse()[:4], "boxed_accuracy")
    assert note.startswith("rounds 1-4: the reward has not risen (0.238 in round 1, 0.194 over the last two")
    assert "not learning yet" in note and "data.examples" in note
    demo = [json.loads(line) for line in (DATA / "demo-seed0-zen4-metrics.jsonl").read_text().splitlines()]
    assert early_note(demo[:4], "boxed_accuracy") is None
    dead = rounds(reward__total__mean=[0.0] * 4, groups__all_equal=[1.0] * 4, groups__all_wrong=[1.0] * 4)
    assert early_note(dead, "accuracy").startswith("rounds 1-4: 100% of the groups gave equal rewards, nearly all")
    assert early_note(dead[:3], "accuracy") is None and early_note(high_lr_collapse()[:5], "accuracy") is None


def test_a_distillation_run_is_read_by_its_kl_to_the_teacher():
    """With a teacher, equal groups and falling entropy are the student taking on a confident
    teacher, not a dead run: those notes stay quiet. A KL to the teacher that does not fall by
    round 4, or rises over the run, is what is said."""
    from plait.telemetry.advice import EARLY_ROUND, early_note

    falling = [1.0, 0.6, 0.4, 0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.06, 0.05, 0.05]
    history = rounds(
        reward__total__mean=[0.0] * 12,
        groups__all_equal=[1.0] * 12,
        groups__all_wrong=[1.0] * 12,
        entropy=[1.0] * 4 + [0.5] * 4 + [0.1] * 4,
        teacher__kl=falling,
    )
    assert health_notes(history, [], CFG, "accuracy") == []
    assert early_note(history[:EARLY_ROUND], "accuracy") is None
    stuck = rounds(reward__total__mean=[0.0] * 4, groups__all_equal=[1.0] * 4, teacher__kl=[0.5, 0.6, 0.55, 0.6])
    assert "the KL to the teacher has not fallen (0.5000 in round 1, 0.5750 over the last two)" in early_note(
        stuck, "accuracy"
    )
    rising = rounds(reward__total__mean=[0.0] * 12, teacher__kl=[0.1] * 4 + [0.2] * 4 + [0.4] * 4)
    (note,) = health_notes(rising, [], CFG, "accuracy")
    assert note.startswith("the KL to the teacher rose (0.1000 -> 0.4000, first vs last third)")


def test_a_fall_in_a_run_with_recovery_on_is_not_told_to_turn_recovery_on():
    history = [
        {"round": i + 1, "reward/total/mean": r} for i, r in enumerate([0.1, 0.5, 0.9, 1.0, 1.0, 0.5, 0.3, 0.2, 0.2])
    ]
    evals = [{"round": 0, "acc": 0.2}, {"round": 5, "acc": 0.6}, {"round": 9, "acc": 0.45}]
    off = health_notes(history, evals, load_config(None, []), "acc")
    assert len(off) == 2 and all("recovery.enabled=true rolls a falling run back" in n for n in off)
    on = health_notes(history, evals, load_config(None, ["recovery.enabled=true", "recovery.margin=0.2"]), "acc")
    assert len(on) == 2 and not any("recovery.enabled=true" in n for n in on)
    assert all("recovery is on (watching the reward, margin 0.2) and did not act" in n for n in on)
    # where it acted, the notes say what it did, not that it did not act
    acted = [{**m, "recovery/rollbacks": 2 if m["round"] > 6 else 0} for m in history]
    ended = [*evals, {"round": 9, "acc": 0.6, "restored": 5}]
    cfg = load_config(None, ["recovery.enabled=true", "recovery.relative_margin=0.1"])
    (note,) = health_notes(acted, ended, cfg, "acc")  # the evaluation ended at its best: only the reward's fall
    assert note.startswith("the reward fell from its peak") and "did not act" not in note
    said = "recovery (watching the reward, margin 0.1, relative 0.1) rolled back 2 time(s), and the run ended on round"
    assert said in note and "round 5's state (final/)" in note
