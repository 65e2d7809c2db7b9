"""recovery's decisions as pure functions of the watched scores (plait.train.recovery), and the
learning-rate scale of one optimizer step (plait.train.optim.scaled_lr)."""

import json

import pytest
import torch

from plait.config import load_config
from plait.train.optim import make_optimizer, scaled_lr
from plait.train.recovery import RecoveryState, decide, floor, reward_score, watched


def test_a_new_best_is_kept_a_fall_past_the_margin_rolls_back_and_the_last_one_stops():
    state = RecoveryState()
    verdicts = []
    for score in (0.30, 0.50, 0.45, 0.39, 0.41):
        verdict = decide(state, score, margin=0.1, max_recoveries=1)
        verdicts.append(verdict)
        if verdict == "best":
            state.best = score
        if verdict == "rollback":
            state.rollbacks += 1
    # 0.45 and 0.41 lie within 0.1 of the best (0.50): kept; 0.39 is past it: the one rollback
    assert verdicts == ["best", "best", "keep", "rollback", "keep"]
    assert decide(state, 0.2, margin=0.1, max_recoveries=1) == "stop"  # every rollback spent
    assert decide(state, 0.55, margin=0.1, max_recoveries=1) == "best"  # a new best is kept even then
    assert decide(RecoveryState(), -5.0, margin=0.1, max_recoveries=0) == "best"  # the first score is the best


def test_a_relative_margin_acts_on_a_fall_the_absolute_one_lets_through():
    """A best accuracy of 0.28 and a last one of 0.21 (a run of bench/collapse_tasks.py's multiply
    at 3e-4): 0.07 below, inside an absolute margin of 0.1, past a tenth of the best (0.028)."""
    assert floor(0.28, 0.1) == pytest.approx(0.18)
    assert floor(0.28, 0.1, 0.1) == pytest.approx(0.252)
    assert floor(0.95, 0.05, 0.1) == pytest.approx(0.90)  # the absolute margin is the nearer one here
    assert floor(-2.0, 0.5, 0.1) == pytest.approx(-2.2)  # a share of a negative best still lies below it
    best = RecoveryState(best=0.28)
    assert decide(best, 0.21, margin=0.1, max_recoveries=2) == "keep"
    assert decide(best, 0.21, margin=0.1, max_recoveries=2, relative_margin=0.1) == "rollback"
    assert decide(best, 0.26, margin=0.1, max_recoveries=2, relative_margin=0.1) == "keep"
    assert load_config(None, ["recovery.relative_margin=0.1"]).recovery.relative_margin == 0.1
    with pytest.raises(Exception, match="relative_margin"):
        load_config(None, ["recovery.relative_margin=1.5"])


def test_the_reward_score_is_the_mean_of_a_full_window():
    state = RecoveryState()
    assert [reward_score(state, r, 3) for r in (1.0, 2.0)] == [None, None]
    assert reward_score(state, 6.0, 3) == pytest.approx(3.0)
    assert reward_score(state, 0.0, 3) == pytest.approx(8.0 / 3)  # the oldest round left the window
    assert state.window == [2.0, 6.0, 0.0]


def test_the_state_goes_through_a_checkpoints_json_unchanged():
    state = RecoveryState(0.5, 12, 1, 0.5, [1.0, 1.5])
    assert RecoveryState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert RecoveryState.from_dict(None) == RecoveryState()  # a checkpoint written before recovery existed


def test_what_recovery_watches():
    assert watched(load_config(None, [])) is None
    assert watched(load_config(None, ["recovery.enabled=true"])) == "reward"
    assert watched(load_config(None, ["recovery.enabled=true", "eval.every_steps=5"])) == "eval"
    assert watched(load_config(None, ["recovery.enabled=true", "recovery.watch=eval"])) == "eval"


def test_a_scaled_step_moves_the_weights_by_the_scale_and_the_schedule_goes_on():
    """AdamW's first step moves each weight by lr x g / (|g| + eps): x 0.25 inside scaled_lr(0.25).
    After it the rate is the schedule's next one (warm-up: 2/4 of the peak), not the scaled one."""
    cfg = load_config(None, ["train.learning_rate=1e-2", "train.warmup_steps=4", "train.max_grad_norm=null"])
    moves = []
    for scale in (1.0, 0.25):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        before = model.weight.detach().clone()
        opt, sched = make_optimizer(model, cfg)
        model(torch.randn(16, 8)).square().mean().backward()
        with scaled_lr(sched, scale):
            assert opt.param_groups[0]["lr"] == pytest.approx(scale * 1e-2 / 4)
            opt.step()
            sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 2 / 4)
        moves.append(model.weight.detach() - before)
    torch.testing.assert_close(moves[1], moves[0] * 0.25, rtol=1e-4, atol=1e-9)
    assert moves[0].abs().min() > 0.9 * 1e-2 / 4  # every weight moved by (about) the whole rate


def test_a_recovery_with_nothing_to_watch_is_refused_before_anything_loads():
    from plait.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"recovery.watch=eval .* set eval.every_steps \(e.g. 5\)"):
        validate(load_config(None, ["recovery.enabled=true", "recovery.watch=eval"]))
    with pytest.raises(ConfigError, match=r"recovery.window=20 rounds, but the run has train.max_steps=20"):
        validate(load_config(None, ["recovery.enabled=true", "recovery.window=20"]))
    validate(load_config(None, ["recovery.enabled=true", "eval.every_steps=5"]))  # the evaluation: fine
