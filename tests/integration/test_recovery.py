"""recovery.enabled for real: a run whose reward falls rolls back to its best state, lowers its
learning rate, goes on with unseen prompts, and ends on its best state once its rollbacks are
spent; a run killed after a rollback resumes to the unbroken run's weights bit for bit; the same
under two DDP processes and with asynchronous rounds.

The fall is planted: `vowel_share_then_less` pays 2, 4 and 6 more in rounds 1-3 and nothing
after, whatever the policy does, so the watched reward (the mean of 2 rounds) rises to round 3
and falls from round 4 on, and every decision is known in advance: the best at round 3, a
rollback at round 4 (its window holds round 3's reward and round 4's), then one at each second
round (the window starts empty after a rollback)."""

from __future__ import annotations

import html
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fault_tolerance import start, wait_for_steps
from test_train import final_weights, tiny_overrides
from test_vllm import metrics_of, train_cmd

from plait.cli import main
from plait.config import load_config
from plait.report import write_report
from plait.train.loop import train
from plait.train.recovery import best_checkpoint


pytestmark = pytest.mark.slow

WATCH = [
    "rewards=[{name: 'plait_test_rewards:vowel_share_then_less'}]",
    "recovery.enabled=true",
    "recovery.watch=reward",
    "recovery.window=2",
    "recovery.margin=0.5",
    "train.lr_scheduler=constant",
    "train.lr_by_signal=false",  # the logged rate is then the schedule's times recovery's scale alone
    "data.shuffle=false",
]


def overrides(model, data, out, *extra):
    return tiny_overrides(model, data, out, *WATCH, *extra)


def consumed(run: Path, round_: int) -> int:
    state = run / "checkpoints" / f"step_{round_:08d}" / "trainer_state.json"
    return json.loads(state.read_text())["prompts_consumed"]


def test_a_fall_rolls_back_to_the_best_state_and_the_last_one_ends_the_run(tiny_model_path, prompts_jsonl, tmp_path):
    run = tmp_path / "run"
    sets = overrides(
        tiny_model_path,
        prompts_jsonl,
        run,
        "train.max_steps=10",
        "recovery.max_recoveries=1",
        "checkpoint.save_steps=1",
        "checkpoint.keep_last=20",
    )
    result = train(load_config(None, sets))
    m = result.history
    # round 4's window fell past the margin: rolled back to round 3's state at half the rate;
    # the window starts again, and round 6's fall, with every rollback spent, ends the run
    assert len(m) == 6
    assert [x["recovery/rollbacks"] for x in m] == [0, 0, 0, 0, 1, 1]
    assert [x["recovery/lr_scale"] for x in m] == [1, 1, 1, 1, 0.5, 0.5]
    assert m[4]["lr"] == pytest.approx(0.5 * m[3]["lr"])
    best = best_checkpoint(run)
    assert best is not None and best.name == "step_00000003"
    kept = load_file(str(best / "model.safetensors"))
    ended = final_weights(run)
    assert all(torch.equal(kept[k], ended[k]) for k in kept)  # the run ends on the best state
    # round 5 trained from round 3's weights: what round 4 learned is gone
    after4 = load_file(str(run / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert all(torch.equal(kept[k], after4[k]) for k in kept)  # checkpoint 4 was written after the rollback
    # the data went on: round 5 drew the prompts after round 4's, not round 4's again
    per_round = consumed(run, 1)
    assert [consumed(run, r) for r in (3, 4, 5)] == [3 * per_round, 4 * per_round, 5 * per_round]
    # the report says so, and marks the round on its accuracy figure
    assert "1 rollback(s) after round(s) 4; learning rate x0.5" in write_report(run).read_text()


def test_a_last_evaluation_that_falls_ends_the_run_on_its_best_state_evaluated_again(
    tiny_model_path, prompts_jsonl, tmp_path
):
    """Watching the evaluation: the one after the last round falls past the margin, so the run
    restores its best state (round 2's), exports that, and evaluates it again; the second "after"
    record is what the run ended with, and plait compare and the report read it, not the fall."""
    import plait_test_rewards

    from plait.compare import compare

    plait_test_rewards.EVALUATIONS["n"] = 0
    run = tmp_path / "runs" / "seed-0"
    sets = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        run,
        "train.max_steps=3",
        "recovery.enabled=true",
        "eval.before=true",
        "eval.after=true",
        "eval.every_steps=2",
        "eval.metric=plait_test_rewards:evaluations_then_a_fall",
    )
    result = train(load_config(None, sets))
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["tag"], e["round"], e.get("restored")) for e in evals] == [
        ("before", 0, None),
        ("round 2", 2, None),
        ("after", 3, None),
        ("after", 3, 2),
    ]
    assert result.eval_after == 0.75  # the restored state's own evaluation (the metric's 4th call)
    best = best_checkpoint(run)
    assert best is not None and best.name == "step_00000002"
    kept, ended = load_file(str(best / "model.safetensors")), final_weights(run)
    assert all(torch.equal(kept[k], ended[k]) for k in kept)  # final/ is round 2's state
    summary, _ = compare([tmp_path / "runs"], tmp_path / "compare")
    (group,) = summary["groups"].values()
    assert group["final"]["values"] == [0.75] and [h["final_over_best"] for h in group["held"]] == [1.0]
    page = html.unescape(write_report(run).read_text())
    assert "0.25 before -> 0.75 after (round 2's state, restored by recovery)" in page


def test_a_run_killed_after_a_rollback_resumes_as_the_unbroken_one(
    tiny_model_path, prompts_jsonl, tmp_path, helper_env
):
    """The decisions (best, rollbacks, rate, the reward window) live in every checkpoint: a run
    stopped after its first rollback and resumed makes the same later rollbacks and ends with the
    unbroken run's weights, every round's samples, rewards and advantages bit for bit."""
    steps = 9
    # the unbroken run and the resume in this process, the stopped run a process of its own: one thread in all
    args = ["recovery.max_recoveries=5", f"train.max_steps={steps}", "log.console=plain", "train.threads=1"]
    straight = tmp_path / "straight"
    train(load_config(None, overrides(tiny_model_path, prompts_jsonl, straight, *args)))
    rollbacks = [x["recovery/rollbacks"] for x in metrics_of(straight)]
    assert rollbacks == [0, 0, 0, 0, 1, 1, 2, 2, 3]  # at rounds 4, 6 and 8
    run = tmp_path / "run"
    sets = overrides(tiny_model_path, prompts_jsonl, run, *args, "checkpoint.save_steps=1")
    proc = start(train_cmd(1, sets), helper_env, tmp_path / "log")
    wait_for_steps(run, 5, proc)  # round 4's rollback is done once round 5 is logged
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    done = [int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file()]
    assert max(done) >= 5 and max(done) < steps, (tmp_path / "log").read_text()[-3000:]
    train(load_config(None, [*sets, "resume=auto"]))
    assert [x["recovery/rollbacks"] for x in metrics_of(run)] == rollbacks
    a, b = final_weights(straight), final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (run / "hashes.jsonl").read_text() == (straight / "hashes.jsonl").read_text()


@pytest.mark.parametrize("layout", ["ddp", "async"])
def test_recovery_rolls_back_under_ddp_and_with_asynchronous_rounds(
    layout, tiny_model_path, prompts_jsonl, tmp_path, helper_env, capsys
):
    """Two DDP processes roll back together (the decision is made from metrics both hold); an
    asynchronous run rolls the trainer back while the rounds already generated ahead are trained
    as the stale rounds they are. Both end on the best state."""
    run = tmp_path / "run"
    extra = ["train.max_steps=8", "recovery.max_recoveries=1", "log.console=plain"]
    if layout == "async":
        extra += ["rollout.max_staleness=1", "train.threads=1"]
    sets = overrides(tiny_model_path, prompts_jsonl, run, *extra)
    if layout == "ddp":
        res = subprocess.run(train_cmd(2, sets), env=helper_env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        said = res.stdout
    else:  # one process: the command in this one
        assert main(["train", *(x for a in sets for x in ("--set", a))]) == 0
        said = capsys.readouterr().out
    assert "rolled back to round 3's state" in said
    assert "the run ends on round 3's state" in said
    assert [x["recovery/rollbacks"] for x in metrics_of(run)] == [0, 0, 0, 0, 1, 1]
    kept = load_file(str(best_checkpoint(run) / "model.safetensors"))
    ended = final_weights(run)
    assert all(torch.equal(kept[k], ended[k]) for k in kept)
