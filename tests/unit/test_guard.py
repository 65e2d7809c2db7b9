"""Pure pieces of fault tolerance: the non-finite guard, log trimming on resume, the
torchrun-restart config check, and the stop signal."""

from __future__ import annotations

import json
import os
import signal

import pytest
from test_config import problems_of

from plait.checkpoint import trim_logs
from plait.config import load_config, validate
from plait.train.guard import NonFiniteGuard, StopSignal, TrainingDiverged


def test_guard_counts_streaks_and_stops_after_the_limit():
    nan, inf = float("nan"), float("inf")
    g = NonFiniteGuard(limit=2)
    assert g.check(True, 1.0, 1) and not g.check(False, nan, 2) and not g.check(False, inf, 3)
    assert g.check(True, 0.5, 4) and g.streak == 0 and g.skipped == 2  # a good step resets the streak
    assert not g.check(False, nan, 5) and not g.check(False, nan, 6)
    with pytest.raises(TrainingDiverged, match="round 7: 3 optimizer steps in a row"):
        g.check(False, nan, 7)
    with pytest.raises(TrainingDiverged):
        NonFiniteGuard(limit=0).check(False, -inf, 1)


def test_trim_logs_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    rows = [{"step": s, "loss": 0.1 * s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    (tmp_path / "eval.jsonl").write_text('{"tag": "before", "step": 0}\n{"tag": "step 4", "step": 4}\n')
    assert trim_logs(tmp_path, 3) == 4  # steps 4, 5, the torn line, and eval at step 4
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [1, 2, 3]
    assert [json.loads(line)["tag"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == ["before"]
    assert trim_logs(tmp_path / "nothing-here", 3) == 0


def test_a_restart_reruns_the_evaluations_written_after_its_checkpoint(tmp_path):
    """From scratch (a kill before the first checkpoint committed) every record goes, the
    evaluation before training included; from the last checkpoint, the final evaluation goes
    (it ran after that checkpoint and runs again)."""
    evals = [{"tag": "before", "step": 0}, {"tag": "step 2", "step": 2}, {"tag": "after", "step": 4}]
    write = lambda: (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))  # noqa: E731
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    write()
    assert trim_logs(tmp_path, 0) == 4
    assert (tmp_path / "metrics.jsonl").read_text() == "" and (tmp_path / "eval.jsonl").read_text() == ""
    write()
    trim_logs(tmp_path, 4)
    assert [json.loads(x)["tag"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == ["before", "step 2"]


def test_torchrun_restarts_need_a_fixed_output_dir(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert any("torchrun --max-restarts" in p and "set output_dir" in p for p in problems_of([]))
    validate(load_config(None, ["output_dir=/tmp/run-x"]))  # no problem left


def test_the_first_signal_asks_to_stop_the_second_interrupts():
    stop = StopSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is not stop._handle  # the second one restored the old handlers
    finally:
        stop.uninstall()


@pytest.mark.parametrize("start", [0, 2])
def test_a_restart_hides_the_tensorboard_events_of_the_rounds_it_reruns(tmp_path, start):
    """A run killed after logging rounds 1-4 restarts from `start` (its checkpoint, or from scratch):
    TensorBoard then shows each round once, with the rerun's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.telemetry.sinks import TensorBoardWriter

    killed = TensorBoardWriter(tmp_path)
    for step in range(0 if start == 0 else 1, 5):
        killed.log(step, {"loss": float(step)})
    killed.close()
    # a restart is a later process: its event file's name (seconds, host, pid, a per-process count)
    # sorts after the killed run's; in this one process both could share a second and the count
    # could pass a digit ("9" sorts after "10"), so the killed run's file is dated a minute back
    for f in (tmp_path / "tensorboard").iterdir():
        secs, rest = f.name.removeprefix("events.out.tfevents.").split(".", 1)
        f.rename(f.with_name(f"events.out.tfevents.{int(secs) - 60:010d}.{rest}"))
    rerun = TensorBoardWriter(tmp_path, start)
    for step in range(start if start == 0 else start + 1, 7):
        rerun.log(step, {"loss": 10.0 + step})
    rerun.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    events = [(e.step, e.value) for e in acc.Scalars("loss")]
    kept = [(s, float(s)) for s in range(1, start + 1)]  # the rounds before the checkpoint, as first logged
    assert events == kept + [(s, 10.0 + s) for s in range(start if start == 0 else start + 1, 7)]


def test_the_drift_guard_checks_synchronous_rounds_against_the_precisions_limit():
    from plait.train.guard import EngineDrift, check_drift

    fp32 = load_config(None, ["train.precision=fp32"])
    bf16 = load_config(None, ["train.precision=bf16", "rollout.precision=fp32"])  # auto follows bf16 on bf16 CPUs
    check_drift(fp32, 3, 4e-7, sampled_version=2)  # healthy
    check_drift(bf16, 3, 0.05, sampled_version=2)  # within bf16's rounding, not fp32's
    check_drift(bf16, 3, 0.14, sampled_version=2)  # a healthy SmolLM2-135M round in bf16 showed 0.135
    with pytest.raises(EngineDrift, match=r"limit 0.5: rollout.max_logprob_gap, rollouts fp32, training bf16"):
        check_drift(bf16, 3, 0.6, sampled_version=2)
    with pytest.raises(EngineDrift, match=r"round 3: .* by 0.02 on average \(limit 0.01.*resume=auto"):
        check_drift(fp32, 3, 0.02, sampled_version=2)
    check_drift(fp32, 3, float("nan"), sampled_version=2)  # the trainer's own numbers broke: the non-finite guard's
    check_drift(fp32, 3, 0.5, sampled_version=1)  # sampled with older weights on purpose (async): not checked
    check_drift(load_config(None, ["rollout.max_logprob_gap=null"]), 3, 0.5, sampled_version=2)  # off
    truncated = ["rollout.engine=vllm", "rollout.top_p=0.9", "train.precision=fp32"]
    check_drift(load_config(None, truncated), 3, 0.5, 2)  # auto: vLLM's log-probs are of the truncated distribution
    with pytest.raises(EngineDrift):  # unless the user sets a limit
        check_drift(load_config(None, [*truncated, "rollout.max_logprob_gap=0.001"]), 3, 0.5, 2)
    with pytest.raises(EngineDrift, match="limit 0.001"):
        check_drift(load_config(None, ["rollout.max_logprob_gap=0.001"]), 3, 0.002, sampled_version=2)
