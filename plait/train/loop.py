"""The GRPO training loop. One round, top to bottom (`train_round`):

    generate a group per prompt and score it  (plait.rollout engine, plait.rewards runner)
    -> collate into a padded batch             (plait.train.batch)
    -> log-prob prepass                         (old / reference log-probs: plait.train.update)
    -> group-relative advantages                (plait.algo.advantages)
    -> the teacher's log-probs                  (distillation: plait.train.teacher)
    -> policy update                            (num_iterations x steps_per_generation optimizer updates)

A *round* is one generation batch; an *update* is one optimizer step (a round holds
steps_per_generation x num_iterations of them). `train.max_steps` counts rounds. Setup lives in
plait.train.setup (`open_run` builds a `Run`); `log_round` is a round's telemetry; checkpoints,
evaluation and the end-of-run summary sit beside the loop, not inside the round.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

from plait import comm
from plait.checkpoint import save_checkpoint, wait_for_saves
from plait.config import Config, resolve_backend, validate
from plait.evaluate import evaluate
from plait.programs.environments import (
    EnvironmentFailed,
    agent_error_problem,
    error_share_problem,
    resume_advice,
    round_errors,
)
from plait.rewards.runner import BoundReward, RewardError, call_rewards, reward_inputs
from plait.rollout.hf import decoding_in
from plait.telemetry.advice import EARLY_ROUND, early_note, health_notes, suggestion
from plait.train.backends import make_backend, resolve_device
from plait.train.batch import collate
from plait.train.guard import Preempted, StopSignal, check_drift
from plait.train.hashes import RoundHashes, gather_hashes, rollout_hashes
from plait.train.hostmem import retained_host_memory
from plait.train.metrics import (
    across_processes,
    agent_counts,
    agent_rates,
    describe_processes,
    phase_summary,
    round_rollout_metrics,
    sample_record,
)
from plait.train.recovery import defend, end_on_best, reward_score, watched
from plait.train.rollouts import SyncRollouts, staleness
from plait.train.sampling import SamplingStats
from plait.train.setup import Run, TrainResult, open_run, trainer_state
from plait.train.teacher import TeacherFailed
from plait.train.update import advantages_first, logprob_prepass, policy_update, step_advantages
from plait.types import Group


__all__ = ["train", "train_round", "TrainResult", "RoundResult"]


@dataclass
class RoundResult:
    """What one round produced, for its telemetry."""

    groups: list[Group]
    sampling: SamplingStats  # generation rounds, kept groups, and the rewards' report
    accuracy: list[float] | None  # eval.metric on each completion (None: the data has no reference)
    update: dict[str, float]  # policy_update's metrics
    prepass_forwards: float  # forward passes of the log-prob prepass, in whole batches
    rollout: dict[str, float]  # async generation: the producer's time and pushes (empty when synchronous)
    hashes: RoundHashes  # this process's, by stage (plait.train.hashes)


def train(cfg: Config, console: str | None = None) -> TrainResult:
    """Run GRPO. Every training process (one, or N under torchrun or Ray) runs this same function."""
    # every config problem and the data's, in one pass, before a run directory exists or anything heavy loads
    plan = validate(cfg)
    backend = make_backend(resolve_backend(cfg, plan.training_processes), cfg, resolve_device(cfg.train.device))
    stop = StopSignal().install()  # SIGTERM/SIGINT: finish the round, checkpoint, exit (Preempted)
    try:
        with retained_host_memory(cfg.train.retain_host_memory), open_run(cfg, plan, backend, console) as run:
            result = run_rounds(run, stop)
    finally:
        stop.uninstall()
        wait_for_saves()  # a save of a finished round still commits, even when the run failed after it
    # only on success: after an error the other processes may be inside another collective,
    # and a barrier here would hang; this process exits instead and torchrun stops the rest
    comm.shutdown()
    return result


def run_rounds(run: Run, stop: StopSignal) -> TrainResult:
    """Rounds start+1 .. max_steps, each followed by its log line, its evaluation and its
    checkpoint (when due); then the end of the run.

    The checkpoint comes last, so every record of a round is written before the round can be
    resumed from: a kill before the commit reruns the round (and its records, trimmed on
    restart), a kill after it loses none. Checkpoint and evaluation time count in the next
    round's time."""
    cfg = run.cfg
    try:
        run.rollouts.start()  # async: the producer starts generating the first rounds now
        if cfg.eval.before and run.start == 0:
            run.result.eval_before = run_eval(run, "before", 0)
            if watched(cfg) == "eval":  # the state before training is the first best
                defend(run, 0, run.result.eval_before, lambda: trainer_state(run))
        run.timer.reset()  # the first round's time starts here: setup and the evaluation before are no round's
        last_save, saved = time.monotonic(), run.start
        for round_ in range(run.start + 1, cfg.train.max_steps + 1):
            consumed = run.order.consumed
            try:
                out = train_round(run, round_)
            except RewardError:
                keep_rounds_done(run, round_ - 1, saved, consumed)
                raise
            except TeacherFailed as err:
                kept = keep_rounds_done(run, round_ - 1, saved, consumed)
                raise TeacherFailed(
                    f"round {round_}: {err}; fix the teacher; {resume_advice(max(saved, kept))}"
                ) from None
            stopping, due = _save_due(cfg, round_, stop, last_save)
            log_round(run, round_, out, saved)
            score = None
            if watched(cfg) == "reward":
                score = reward_score(run.recovery, run.result.history[-1]["reward/total/mean"], cfg.recovery.window)
            evaluate = cfg.eval.every_steps and round_ % cfg.eval.every_steps == 0 and round_ < cfg.train.max_steps
            # a preempted round saves at once instead, unless recovery decides by this evaluation (the
            # resumed run must decide as the unbroken one)
            if evaluate and (not stopping or watched(cfg) == "eval"):
                with run.timer("eval"):
                    accuracy = run_eval(run, f"round {round_}", round_)
                score = accuracy if watched(cfg) == "eval" else score
            ended = score is not None and defend(run, round_, score, lambda: trainer_state(run))
            if due or ended:  # a run that ends early saves here, while an async producer still runs
                with run.timer("checkpoint"):  # async: only the copy to CPU (and waiting for the previous save)
                    save(run, round_, blocking=stopping or ended or not cfg.checkpoint.async_save)
                last_save, saved = time.monotonic(), round_
            if stopping:
                run.sink.close()
                raise Preempted(run.run_dir, round_, stop.requested or "a stop signal on another process")
            if ended:
                break
    finally:
        run.rollouts.close()
    finish_run(run, round_ if run.start < cfg.train.max_steps else run.start, saved)
    return run.result


def train_round(run: Run, round_: int) -> RoundResult:
    """Round `round_`: generate and score -> collate -> log-prob prepass -> advantages -> update."""
    cfg, timer = run.cfg, run.timer
    taken = run.rollouts.take(round_)  # generated now, or by the async producer
    groups, sampling = taken.groups, taken.sampling
    with timer("score"):
        accuracy = step_accuracy(groups, run.metric, sampling)
    batch = collate(groups, run.engine.pad_id, cfg.algo.mask_truncated_completions)
    names, weights = [r.name for r in run.rewards], [r.weight for r in run.rewards]
    if advantages_first(cfg):  # the prepass then leaves out the rows they zero
        batch.advantages = step_advantages(groups, batch, cfg, names, weights)
    with timer("logprobs"):
        forwards = logprob_prepass(batch, cfg, run.backend)
    if not advantages_first(cfg):  # the KL in the reward: from the prepass's log-probs
        batch.advantages = step_advantages(groups, batch, cfg, names, weights)
    if run.teacher is not None:  # whatever weights sampled them: the update compares its own
        with timer("teacher"):
            if cfg.teacher.top_k:
                top = run.teacher.top_logprobs(batch)
                batch.teacher_logprobs, batch.teacher_top_ids, batch.teacher_top_logprobs = top
            else:
                batch.teacher_logprobs = run.teacher.logprobs(batch)
    hashes = rollout_hashes(groups, batch)  # what was sampled, scored and advantaged, for `plait diff`
    deep = hashes if cfg.train.deterministic else None  # ... and the trainer's gradient and weights
    update = policy_update(batch, cfg, run.backend, run.guard, round_, timer, deep, run.recovery.lr_scale)
    if deep is not None:
        with timer("hashes"):
            deep.add_weights(run.backend.module)
    check_drift(cfg, round_, update["logprob_gap/before_update"], taken.sampled_version)
    run.rollouts.publish(round_)  # async: these weights, for the rounds scheduled on them
    return RoundResult(groups, sampling, accuracy, update, forwards, taken.info, hashes)


def step_accuracy(groups: list[Group], metric: BoundReward, sampling: SamplingStats) -> list[float] | None:
    """The eval metric on this round's completions (reusing its scores when it is also a
    reward); code it runs counts in the round's sandbox figures."""
    has_reference = "tests" in groups[0].prompt.columns if metric.needs_sandbox else groups[0].prompt.answer is not None
    if not has_reference:
        return None
    if metric.name in groups[0].rewards:
        return [v or 0.0 for g in groups for v in g.rewards[metric.name]]
    values, report = call_rewards([metric], reward_inputs(groups))
    sampling.rewards = sampling.rewards.merge(report)
    return [v or 0.0 for v in values[metric.name]]


def log_round(run: Run, round_: int, out: RoundResult, saved: int) -> None:
    """A round's telemetry: rollout and update metrics, reward and sandbox health, time per
    phase (the slowest process's), throughput/MFU/memory; to every sink, with samples. Stops the
    run when environments or the agent failed past their share (`saved`: the last checkpoint's
    round, 0 for none, which the stop message says how to resume from)."""
    cfg, update = run.cfg, out.update
    if update["nonfinite_steps"]:
        run.say(
            f"[yellow]round {round_}: {update['nonfinite_steps']:.0f} optimizer step(s) skipped: non-finite gradient "
            f"norm (weights, optimizer and LR schedule untouched; {run.guard.streak} in a row, limit {run.guard.limit})"
        )
    metrics = {**round_rollout_metrics(out.groups, out.accuracy), **update, **run.engine.stats()}
    health = out.sampling.rewards.metrics([r.name for r in run.rewards], run.sandbox is not None)
    metrics.update(across_processes(out.sampling.metrics(), health, agent_counts(out.groups)))
    metrics.update(agent_rates(metrics))
    lag = staleness(out.groups, round_ - 1)
    if lag:  # engines holding a copy of the weights: rounds behind the trainer they sampled (0 when synced)
        total, tokens = comm.all_sum([float(sum(lag)), float(len(lag))])
        metrics["rollout/staleness_mean"] = total / tokens
        metrics["rollout/weight_staleness"] = comm.all_max([float(max(lag))])[0]
    metrics.update(out.rollout)
    if cfg.recovery.enabled:  # the decisions up to the previous round's (this round's come after its log)
        metrics["recovery/rollbacks"] = float(run.recovery.rollbacks)
        metrics["recovery/lr_scale"] = run.recovery.lr_scale
    times = run.timer.reset()
    times = dict(zip(times, comm.all_max(list(times.values()))))  # the slowest process sets the pace
    metrics.update(times)
    metrics["tokens/s_generate"] = metrics["tokens/generated"] / max(1e-9, metrics.get("time/generate", 0.0))
    flops = run.meter.flops(
        out.groups, cfg.algo.num_iterations, out.prepass_forwards, metrics.get("update/forwarded_share", 1.0)
    )
    metrics.update(run.meter.measure(flops, metrics.pop("tokens/processed"), times))
    run.sink.log(round_, metrics)
    run.result.history.append(metrics)
    errors = {**out.sampling.rewards.errors, **round_errors(out.groups)}
    failing = error_share_problem(cfg.environments, metrics, round_, saved, errors) or agent_error_problem(
        cfg.rollout.agent, metrics, round_, saved, errors
    )
    if failing:  # every process sees the same gathered counts, so all stop here
        raise EnvironmentFailed(failing)
    hashes = gather_hashes(out.hashes)
    if comm.is_main():
        with (run.run_dir / "hashes.jsonl").open("a") as f:
            f.write(json.dumps({"round": round_, "step": round_, **hashes}) + "\n")
    early = early_note(run.result.history, cfg.eval.metric) if round_ == EARLY_ROUND and not run.start else None
    if early:  # a run that is not learning by now is told so now, not at its end
        run.say(f"[bold yellow]learning[/]: {early}")
    if comm.is_main() and cfg.log.sample_every_steps and round_ % cfg.log.sample_every_steps == 0:
        run.sink.samples(round_, [sample_record(round_, g) for g in out.groups[: cfg.log.samples]])


def run_eval(run: Run, tag: str, version: int, restored: int | None = None) -> float:
    """Greedy accuracy on the held-out prompts with the weights after `version` rounds (or, when
    recovery restored them, `restored` round's): each process decodes its share, the counts are
    summed."""
    cfg = run.cfg
    tokens = cfg.eval.max_completion_length or cfg.rollout.max_completion_length
    with run.engine.weights_for_round(version), decoding_in(cfg.train.precision):
        res = evaluate(
            run.program,
            run.engine,
            run.eval_prompts[comm.rank() :: comm.world_size()],
            run.metric,
            tokens,
            cfg.rollout.stop,
        )
    correct, n = comm.all_sum([res.accuracy * res.n, res.n])
    accuracy = correct / max(1.0, n)
    per_env = environment_accuracy(run, res)
    shown = "".join(f", {label} {acc:.3f}" for label, acc in per_env.items())
    state = "" if restored is None else f" (round {restored}'s state, restored)"
    say = f"[bold cyan]eval {tag}[/]{state}: {cfg.eval.metric} = {accuracy:.3f} on {n:.0f} held-out prompts (greedy)"
    run.say(say + shown)
    if comm.is_main():
        with (run.run_dir / "eval.jsonl").open("a") as f:
            record = {"tag": tag, "round": version, "step": version, cfg.eval.metric: accuracy, "n": int(n)}
            record.update({} if restored is None else {"restored": restored})
            record.update({f"env/{label}": acc for label, acc in per_env.items()})
            f.write(json.dumps(record) + "\n")
    if cfg.checkpoint.keep_best:
        keep_if_best(run, version, accuracy)
    return accuracy


def environment_accuracy(run: Run, res) -> dict[str, float]:
    """The evaluation's mean score per environment, over every process's prompts."""
    labels = sorted({str(p.columns["environment"]) for p in run.eval_prompts if "environment" in p.columns})
    if not labels:
        return {}
    sums = comm.all_sum([v for label in labels for v in res.by_environment.get(label, (0.0, 0))])
    return {label: sums[2 * i] / max(1.0, sums[2 * i + 1]) for i, label in enumerate(labels)}


def keep_if_best(run: Run, version: int, accuracy: float) -> None:
    """checkpoint.keep_best: export the model to RUN_DIR/best when this evaluation beats the
    best so far (every process takes part; the old folder is replaced only once the new one is
    complete)."""
    best, record = run.run_dir / "best", run.run_dir / "best" / "best.json"
    metric = run.cfg.eval.metric
    previous = json.loads(record.read_text())[metric] if record.is_file() else None
    if comm.broadcast_object(previous is not None and accuracy <= previous):
        return
    tmp = run.run_dir / "best.tmp"
    run.backend.export(tmp, run.tokenizer)
    if comm.is_main():
        (tmp / "best.json").write_text(json.dumps({"round": version, "step": version, metric: accuracy}) + "\n")
        shutil.rmtree(best, ignore_errors=True)
        os.replace(tmp, best)
        run.say(f"best {metric} so far ({accuracy:.3f} at round {version}): model kept in {best}")


def save(run: Run, round_: int, blocking: bool = True) -> None:
    """A checkpoint of the run after round `round_` (every process takes part); async runs add
    the rounds already generated for the next ones, and the data position after them."""
    source = run.rollouts.state(round_)
    save_checkpoint(
        run.run_dir,
        round_,
        run.backend,
        trainer_state(run, source.consumed),
        run.cfg.checkpoint.keep_last,
        blocking=blocking,
        rollouts=source.ahead,
    )


def keep_rounds_done(run: Run, done: int, saved: int, consumed: int) -> int:
    """A reward failed in round done+1, before its update: checkpoint rounds saved+1..done, so
    that fixing the reward and resume=auto loses none of them. The data position goes back to
    the failed round's start (`consumed`), whose prompts the resumed run draws again. Only for
    one process generating its own rounds: another process may be waiting in a collective this
    one will not join, and an async producer has already drawn rounds ahead."""
    if done <= saved or comm.world_size() > 1 or not isinstance(run.rollouts, SyncRollouts):
        return saved
    run.order.consumed = consumed
    save(run, done)
    run.say(f"rounds {saved + 1}-{done} kept in a checkpoint: fix the failure, then resume=auto continues from there")
    return done


def _save_due(cfg: Config, round_: int, stop: StopSignal, last_save: float) -> tuple[bool, bool]:
    """(stop now, save a checkpoint now), the same in every process: a signal may reach only
    some of them, and rank 0's clock decides the time-based saves."""
    c = cfg.checkpoint
    final = round_ == cfg.train.max_steps  # the end of the run saves anyway
    by_time = (
        bool(c.save_every_minutes) and time.monotonic() - last_save >= 60 * c.save_every_minutes and comm.is_main()
    )
    stopping, by_time = (bool(x) for x in comm.all_max([float(stop.requested is not None), float(by_time)]))
    by_steps = bool(c.save_steps) and round_ % c.save_steps == 0
    return stopping and not final, not final and (by_steps or by_time or stopping)


def finish_run(run: Run, last: int, saved: int) -> None:
    """The final checkpoint after round `last` unless round `saved` is it (so the run can be
    resumed or extended), the last evaluation, the exported model and the summary. With recovery
    watching the evaluation, a last evaluation past the margin below the best ends the run on the
    best state."""
    cfg = run.cfg
    run.sink.close()
    if saved < last:
        save(run, last)
    if cfg.eval.after:
        run.result.eval_after = run_eval(run, "after", last)
        restored = end_on_best(run, run.result.eval_after)
        if restored is not None:  # what the run ends with is measured, not assumed: a second "after" record
            run.result.eval_after = run_eval(run, "after", last, restored)
    if cfg.checkpoint.save_final_model:
        run.backend.export(run.run_dir / "final", run.tokenizer)
    describe_processes(run.backend, run.run_dir, run.say, final=True)
    _summary(run)


def _summary(run: Run) -> None:
    cfg, result, run_dir, say = run.cfg, run.result, run.run_dir, run.say
    total, shares = phase_summary(result.history)
    say(
        f"[bold]done[/]: {len(result.history)} rounds in {total:.0f}s; time per phase: "
        + ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
    )
    tip = suggestion(shares, cfg)
    if tip:
        say(f"[bold yellow]suggestion[/]: {tip}")
    path = run_dir / "eval.jsonl"  # written by rank 0, which prints the notes
    evals = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    for note in health_notes(result.history, evals, cfg, cfg.eval.metric):
        say(f"[bold yellow]learning[/]: {note}")
    report = f"report: `plait report {run_dir}` (HTML + figures)"
    say(f"{report}; TensorBoard: `tensorboard --logdir {run_dir}`" if cfg.log.tensorboard else report)
    if result.eval_before is not None and result.eval_after is not None:
        say(f"[bold green]{cfg.eval.metric}: {result.eval_before:.3f} before -> {result.eval_after:.3f} after[/]")
    if cfg.checkpoint.save_final_model:
        final = run_dir / "final"
        say(f"model saved to {final} (load it with transformers' from_pretrained, or `plait eval {run_dir}`)")
