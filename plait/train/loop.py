"""The GRPO training loop. One step, top to bottom:

    prompts -> generate a group per prompt -> score -> group-relative advantages
            -> clipped policy update (num_iterations passes) -> log -> checkpoint

Everything the loop calls is a small function or interface: the rollout engine
(plait.rollout), reward runner (plait.rewards.runner), algorithm (plait.algo, pure tensor
functions), backend (how gradients are computed and applied) and checkpoint store.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import defaultdict
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from plait.algo.advantages import combine_rewards
from plait.algo.kl import mix_reference, sequence_kl
from plait.algo.logprobs import can_pack, completion_logprobs, packed_group_logprobs, prompt_runs, shared_prompt_logprobs
from plait.algo.losses import LossSettings, StepCounts, engine_mismatch_weights, high_entropy_mask, policy_loss
from plait.checkpoint import find_checkpoint, latest_checkpoint, load_checkpoint, resume_position, save_checkpoint, trim_logs, wait_for_saves
from plait.cluster import comm
from plait.config import Config, ConfigError, resolve_backend, validate
from plait.data import PromptOrder, build_prompts, load_rows
from plait.evaluate import evaluate
from plait.models import load_tokenizer
from plait.plan import BatchPlan
from plait.rewards import resolve_reward
from plait.rewards.code import STATS as SANDBOX_STATS, configure as configure_sandbox, sandbox_settings, uses_sandbox
from plait.rewards.runner import SECONDS as REWARD_SECONDS, TIMEOUTS, BoundReward, bind_rewards, call_reward, reward_inputs
from plait.rollout import make_engine
from plait.telemetry import MetricsSink, PhaseTimer
from plait.telemetry.advice import suggestion
from plait.telemetry.flops import device_peak, model_cost
from plait.telemetry.memory import MemoryMeter
from plait.telemetry.meter import StepMeter
from plait.train.backends import make_backend, resolve_device
from plait.train.batch import collate, micro_batches
from plait.train.guard import NonFiniteGuard, Preempted, StopSignal
from plait.train.hostmem import retained_host_memory
from plait.train.metrics import across_processes, describe_processes, phase_summary, sample_record, step_rollout_metrics
from plait.train.sampling import collect_groups
from plait.types import Batch, Group


@dataclass
class TrainResult:
    run_dir: Path
    eval_before: float | None = None
    eval_after: float | None = None
    history: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------- setup


def apply_plan(cfg: Config, plan: BatchPlan, say) -> Config:
    """Write values chosen by auto_batch into the config (and say so): nothing changes silently."""
    for note in plan.notes:
        say(f"[yellow]{note}")
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.prompts_per_step = plan.prompts_per_step
    cfg.train.micro_batch_size = plan.micro_batch_size
    cfg.train.gradient_accumulation_steps = plan.gradient_accumulation_steps
    return cfg


def prepare_run_dir(cfg: Config) -> tuple[Path, Path | None]:
    """The run directory, and the checkpoint to resume from (None for a fresh start): rank 0
    decides (its clock names a new run), every process gets the same answer."""
    decided = None
    if comm.is_main():
        try:
            decided = _choose_run_dir(cfg)
        except ConfigError as err:
            decided = err.problems
    decided = comm.broadcast_object(decided)
    if isinstance(decided, list):
        raise ConfigError(decided)
    return decided


def _choose_run_dir(cfg: Config) -> tuple[Path, Path | None]:
    if cfg.resume not in ("never", "auto"):
        ckpt = find_checkpoint(Path(cfg.resume))  # validate() made sure there is one
        return ckpt.parent.parent, ckpt
    run_dir = Path(cfg.output_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    existing = latest_checkpoint(run_dir)
    if restarted_by_torchrun() and cfg.output_dir:  # torchrun --max-restarts started us again: continue
        return run_dir, existing
    if existing is not None and cfg.resume == "never":
        raise ConfigError(
            [f"output_dir '{run_dir}' already holds checkpoints (newest: {existing.name}); "
             f"continue it with `plait train --resume {run_dir}`, or choose another output_dir"]
        )
    return run_dir, existing if cfg.resume == "auto" else None


def restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- the policy update


def loss_settings(cfg: Config) -> LossSettings:
    a = cfg.algo
    return LossSettings(
        a.loss_type, a.epsilon, a.epsilon_high, a.delta, a.importance_sampling_level,
        0.0 if a.kl_in_reward else a.beta, a.kl_estimator, a.entropy_coeff,
    )


def shares_prompts(cfg: Config, backend) -> bool:
    """Whether a group's prompt goes through the model once for all its completions: one
    process (DDP/FSDP/ZeRO hook one forward per backward) and no activation checkpointing
    (it recomputes without a KV cache)."""
    return cfg.train.shared_prompt_pass and backend.name == "local" and not cfg.model.gradient_checkpointing


def sequence_logprobs(model, mb: Batch, temperature: float, with_entropy: bool = False, shared: bool = False):
    """[B, C] completion log-probs (and entropies) of a micro-batch; with `shared`, rows with
    the same prompt share one prompt pass, and (where the model allows) each group is packed
    into one row without padding (same numbers to float rounding, fewer FLOPs)."""
    if shared:
        runs = prompt_runs(mb.input_ids, mb.attention_mask, mb.prompt_len)
        if can_pack(model):  # one row per group, no padding at all
            return packed_group_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, runs, temperature, with_entropy)
        if len(runs) < len(mb) and mb.prompt_len > 1:  # a 1-token prompt has nothing to share
            return shared_prompt_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, runs, temperature, with_entropy)
    return completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature, with_entropy)


def reference_logprobs(model, ref_model, mb: Batch, temperature: float, shared: bool = False) -> torch.Tensor:
    """log-probs under the reference: a separate copy, or the base model under LoRA."""
    ctx = model.disable_adapter() if ref_model is None else nullcontext()
    with ctx:
        return sequence_logprobs(ref_model or model, mb, temperature, shared=shared)


@torch.no_grad()
def logprob_prepass(batch: Batch, cfg: Config, backend) -> int:
    """Fill batch.old_logprobs (needed when the policy moves before a row is trained on, or
    for the KL reward) and batch.ref_logprobs (beta > 0), micro-batch by micro-batch.
    Returns the number of forward passes made over the batch."""
    a = cfg.algo
    need_old = a.num_iterations > 1 or a.steps_per_generation > 1 or a.kl_in_reward
    if not need_old and a.beta == 0:
        return 0
    model, ref_model = backend.module, backend.ref_model
    temperature = cfg.rollout.temperature or 1.0
    old = torch.zeros_like(batch.completion_mask, dtype=torch.float32)
    ref = torch.zeros_like(old)
    shared = shares_prompts(cfg, backend)
    size = cfg.train.micro_batch_size
    for start, mb in zip(range(0, len(batch), size), micro_batches(batch, size)):
        mb = mb.to(backend.device)
        rows, cols = slice(start, start + len(mb)), slice(0, mb.completion_mask.shape[1])
        with backend.autocast():
            if need_old:
                old[rows, cols] = sequence_logprobs(model, mb, temperature, shared=shared).float().cpu()
            if a.beta > 0:
                ref[rows, cols] = reference_logprobs(model, ref_model, mb, temperature, shared).float().cpu()
    batch.old_logprobs = old if need_old else None
    batch.ref_logprobs = ref if a.beta > 0 else None
    return int(need_old) + int(a.beta > 0)


def step_advantages(groups: list[Group], batch: Batch, cfg: Config, reward_names: list[str], weights: list[float]) -> torch.Tensor:
    """[B] advantages of this process's rows from every reward (None -> NaN), with the KL
    penalty as one more reward (weight beta) when `kl_in_reward`. Rewards of every process's
    groups are gathered first, so batch-level statistics (scale_rewards=batch) see the whole
    step, exactly as in one process."""
    nan = float("nan")
    per_reward = torch.tensor(
        [[[nan if v is None else v for v in g.rewards[name]] for g in groups] for name in reward_names], dtype=torch.float32
    )
    w = torch.tensor(weights, dtype=torch.float32)
    a = cfg.algo
    if a.kl_in_reward:
        seq_kl = sequence_kl(batch.old_logprobs, batch.ref_logprobs, batch.completion_mask, a.kl_estimator)
        per_reward = torch.cat([per_reward, -seq_kl.reshape(1, len(groups), -1)])
        w = torch.cat([w, torch.tensor([a.beta])])
    everyone = comm.all_gather_rows(per_reward, dim=1)  # [R, groups of all processes, n]
    adv = combine_rewards(everyone, w, a.reward_aggregation, a.scale_rewards)
    mine = slice(comm.rank() * len(groups), (comm.rank() + 1) * len(groups))
    return adv[mine].reshape(-1)


def train_micro_batch(model, mb: Batch, counts: StepCounts, cfg: Config, settings: LossSettings, backend) -> dict[str, float]:
    """Forward, loss and backward for one micro-batch; returns its summed statistics."""
    a = cfg.algo
    with_entropy = a.top_entropy_quantile < 1 or a.entropy_coeff > 0
    with backend.autocast():
        out = sequence_logprobs(model, mb, cfg.rollout.temperature or 1.0, with_entropy, shares_prompts(cfg, backend))
    logp, entropy = (out[0].float(), out[1].float()) if with_entropy else (out.float(), None)
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()  # one pass: ratio is exactly 1
    mask = high_entropy_mask(entropy.detach(), mb.completion_mask, a.top_entropy_quantile) if entropy is not None else mb.completion_mask
    weights = engine_mismatch_weights(old, mb.sampling_logprobs, a.engine_is_cap) if a.engine_is_correction else None
    loss, parts = policy_loss(logp, old, mb.advantages, mask, counts, settings, mb.ref_logprobs, entropy, weights)
    backend.backward(loss)
    real = mb.completion_mask.float()
    extra = {
        "logprob_gap_tokens": ((logp.detach() - mb.sampling_logprobs).abs() * real).sum(),
        "trained_tokens": mask.float().sum(),
    }
    if entropy is not None:
        extra["entropy_tokens"] = (entropy.detach() * real).sum()
    named = {"loss": loss.detach(), **parts, **extra}
    return dict(zip(named, torch.stack(list(named.values())).tolist()))  # one device->host sync


# per-process sums in policy_update that add up over processes (the rest are global already)
_PER_PROCESS = ("loss", "clip_low_tokens", "clip_high_tokens", "ratio_tokens", "logprob_gap_tokens", "trained_tokens", "entropy_tokens", "kl_tokens")


def policy_update(batch: Batch, cfg: Config, backend, guard: NonFiniteGuard | None = None, step: int = 0,
                  timer: PhaseTimer | None = None) -> dict[str, float]:
    """num_iterations passes over the generation batch, split into steps_per_generation
    optimizer steps, each accumulating gradients over its micro-batches. The loss is
    normalized by the step's counts over all processes, so gradients sum over processes.
    A step with a non-finite gradient is skipped by the backend; `guard` counts it.
    Timed as `train` (forward + backward) and `optimizer` (clip + step)."""
    a = cfg.algo
    guard = guard or NonFiniteGuard(cfg.train.max_nonfinite_steps)
    timer = timer or PhaseTimer()
    settings = loss_settings(cfg)
    rows = len(batch) // a.steps_per_generation
    sums: dict[str, float] = defaultdict(float)
    scheduler = backend.scheduler
    for _ in range(a.num_iterations):
        for part in range(a.steps_per_generation):
            chunk = batch.slice(part * rows, (part + 1) * rows)
            mbs = [mb.to(backend.device) for mb in micro_batches(chunk, cfg.train.micro_batch_size)]
            seqs, toks, n_mbs = comm.all_sum([len(chunk), float(chunk.completion_mask.sum()), len(mbs)])
            counts = StepCounts(int(seqs), int(toks), int(n_mbs), cfg.rollout.max_completion_length)
            with timer("train"):
                for i, mb in enumerate(mbs):
                    with backend.accumulate(last=i == len(mbs) - 1):
                        for k, v in train_micro_batch(backend.model, mb, counts, cfg, settings, backend).items():
                            sums[k] += v
            sums["real_tokens"] += toks
            sums["processed_tokens"] += float(chunk.attention_mask.sum())  # this process's, prompts included
            with timer("optimizer"):
                norm = backend.step(cfg.train.max_grad_norm)
            sums["lr"] += scheduler.get_last_lr()[0]
            if not guard.check(norm, step):  # skipped: the LR schedule waits for a real update
                sums["nonfinite_steps"] += 1
                continue
            sums["grad_norm"] += norm
            sums["applied_steps"] += 1
            scheduler.step()
            if a.ref_model_sync_steps and scheduler.last_epoch % a.ref_model_sync_steps == 0:
                mix_reference(backend.ref_model, backend.module, a.ref_model_mixup_alpha)
                sums["ref_syncs"] += 1
    keys = [k for k in _PER_PROCESS if k in sums]
    sums.update(zip(keys, comm.all_sum([sums[k] for k in keys])))
    steps = a.num_iterations * a.steps_per_generation
    tokens = max(1.0, sums["real_tokens"])
    out = {"loss": sums["loss"] / steps, "grad_norm": sums["grad_norm"] / max(1.0, sums["applied_steps"]), "lr": sums["lr"] / steps}
    out["nonfinite_steps"] = sums["nonfinite_steps"]
    out["tokens/processed"] = sums["processed_tokens"]
    out["clip/low"] = sums["clip_low_tokens"] / tokens
    out["clip/high"] = sums["clip_high_tokens"] / tokens
    out["clip/fraction"] = out["clip/low"] + out["clip/high"]
    out["ratio/mean"] = sums["ratio_tokens"] / tokens
    out["logprob_gap"] = sums["logprob_gap_tokens"] / tokens  # engine vs trainer, mean |diff|
    out["tokens/trained_share"] = sums["trained_tokens"] / tokens
    if "entropy_tokens" in sums:
        out["entropy"] = sums["entropy_tokens"] / tokens
    if "kl_tokens" in sums:
        out["kl"] = sums["kl_tokens"] / tokens
    if a.ref_model_sync_steps:
        out["ref_syncs"] = sums["ref_syncs"]
    return out


# ---------------------------------------------------------------- the loop


def train(cfg: Config, console: str | None = None) -> TrainResult:
    """Run GRPO. Every training process (one, or N under torchrun) runs this same function."""
    plan = validate(cfg)  # every config problem, before anything heavy loads
    device = resolve_device(cfg.train.device)
    backend = make_backend(resolve_backend(cfg, plan.training_processes), cfg, device)  # joins the process group
    stop = StopSignal().install()  # SIGTERM/SIGINT: finish the step, checkpoint, exit (Preempted)
    try:
        with retained_host_memory(cfg.train.retain_host_memory):  # no page faults for reused big tensors
            result = _train(cfg, plan, backend, console, stop)
    finally:
        stop.uninstall()
        wait_for_saves()  # a save of a finished step still commits, even when the run failed after it
    # only on success: after an error the other processes may be inside another collective,
    # and a barrier here would hang; this process exits instead and torchrun stops the rest
    comm.shutdown()
    return result


def _train(cfg: Config, plan: BatchPlan, backend, console: str | None, stop: StopSignal) -> TrainResult:
    main = comm.is_main()
    run_dir, resume_from = prepare_run_dir(cfg)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    sink = MetricsSink(None, cfg.train.max_steps, (console or cfg.log.console) if main else "none", every=cfg.log.every_steps)
    say = sink.print
    cfg = apply_plan(cfg, plan, say)
    if cfg.train.backend == "auto":  # plait chose: say so, and record it in the resolved config
        cfg.train.backend = backend.name
        say(f"train.backend=auto -> {backend.name} ({plan.training_processes} training process{'es' if plan.training_processes > 1 else ''})")
    if main:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        sink.open(run_dir, cfg.log, cfg.model_dump(mode="json"))
    try:
        return _run(cfg, plan, backend, sink, stop, run_dir, resume_from)
    finally:
        sink.finish()


def _run(cfg: Config, plan: BatchPlan, backend, sink: MetricsSink, stop: StopSignal, run_dir: Path, resume_from: Path | None) -> TrainResult:
    main, say = comm.is_main(), sink.print
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.seed)
    say(f"[bold]plait[/] run dir {run_dir}  |  {plan.prompts_per_step} prompts x {plan.num_generations} generations "
        f"over {plan.training_processes} process(es) ({backend.name}, {cfg.train.precision}), micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps} accumulation")
    rewards = bind_rewards(cfg.rewards)
    metric = BoundReward(cfg.eval.metric, resolve_reward(cfg.eval.metric))
    sandboxed = uses_sandbox(cfg)
    if sandboxed:  # refuses (SandboxUnavailable) below sandbox.min_tier, before any model loads
        tier = configure_sandbox(sandbox_settings(cfg.sandbox))
        say(f"sandbox: model-written code runs under isolation tier '{tier}' (minimum '{cfg.sandbox.min_tier}'; `plait sandbox` shows why)")

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    train_prompts = build_prompts(load_rows(cfg.data, "train", cfg.seed), tokenizer, cfg.data, log=say)
    evaluating = cfg.eval.before or cfg.eval.after or cfg.eval.every_steps
    eval_prompts = build_prompts(load_rows(cfg.data, "eval", cfg.seed), tokenizer, cfg.data, log=say) if evaluating else []
    backend.load(cfg)  # model (+ reference) + optimizer, sharded as the backend does it
    describe_processes(backend, run_dir, say)
    meter = make_meter(cfg, backend, say)
    engine = make_engine(cfg, backend.module, tokenizer, view=backend.for_generation, device=backend.device)
    order = PromptOrder(len(train_prompts), cfg.seed, cfg.data.shuffle, rank=comm.rank(), stride=comm.world_size())
    pad_id = engine.pad_id

    def take_prompts(n: int):
        return [train_prompts[i] for i in order.take(n)]

    start, result = 0, TrainResult(run_dir)
    if resume_from is not None:
        state = load_checkpoint(resume_from, backend)
        start, order.consumed = state["step"], resume_position(state, comm.rank(), comm.world_size(), say)
        result.eval_before = state.get("eval_before")
        dropped = trim_logs(run_dir, start) if main else 0
        say(f"resumed from {resume_from} (step {start})" + (f"; {dropped} log line(s) after it dropped (those steps run again)" if dropped else ""))
    eval_tokens = cfg.eval.max_completion_length or cfg.rollout.max_completion_length

    def run_eval(tag: str) -> float:
        # each process greedy-decodes its share of the held-out prompts; the counts are summed
        with engine.weights_for_step(step):
            res = evaluate(engine, eval_prompts[comm.rank():: comm.world_size()], metric, eval_tokens, cfg.rollout.stop)
        SANDBOX_STATS.take()  # evaluation's executions are not a training step's cost
        correct, n = comm.all_sum([res.accuracy * res.n, res.n])
        accuracy = correct / max(1.0, n)
        say(f"[bold cyan]eval {tag}[/]: {cfg.eval.metric} = {accuracy:.3f} on {n:.0f} held-out prompts (greedy)")
        if main:
            with (run_dir / "eval.jsonl").open("a") as f:
                f.write(json.dumps({"tag": tag, "step": step, cfg.eval.metric: accuracy, "n": int(n)}) + "\n")
        return accuracy

    step = start
    if cfg.eval.before and start == 0:
        result.eval_before = run_eval("before")

    if sink.progress is not None:
        sink.progress.update(sink.task, completed=start)
    timer = PhaseTimer()
    names, weights = [r.name for r in rewards], [r.weight for r in rewards]
    prompts_per_round = plan.prompts_per_process * cfg.algo.steps_per_generation
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
    last_save = time.monotonic()
    for step in range(start + 1, cfg.train.max_steps + 1):
        with ExitStack() as step_weights:
            with timer("weight_sync"):  # HF: gather sharded weights once for the step; vLLM: copy them in
                step_weights.enter_context(engine.weights_for_step(step - 1))
            groups, sampling = collect_groups(engine, take_prompts, prompts_per_round, cfg, step, rewards, timer)
        with timer("score"):
            accuracy = step_accuracy(groups, metric)
        batch = collate(groups, pad_id, cfg.algo.mask_truncated_completions)
        with timer("reference"):
            prepass_forwards = logprob_prepass(batch, cfg, backend)
        batch.advantages = step_advantages(groups, batch, cfg, names, weights)
        update = policy_update(batch, cfg, backend, guard, step, timer)
        if update["nonfinite_steps"]:
            say(f"[yellow]step {step}: {update['nonfinite_steps']:.0f} optimizer step(s) skipped: non-finite gradient norm "
                f"(weights, optimizer and LR schedule untouched; {guard.streak} in a row, limit {guard.limit})")

        metrics = {**step_rollout_metrics(groups, accuracy), **update, **getattr(engine, "sync_stats", {})}
        metrics.update(across_processes(sampling.metrics(), reward_health(rewards, sandboxed)))
        versions = [c.weight_version for g in groups for c in g.completions if c.weight_version is not None]
        if versions:  # engines holding a copy of the weights: how many updates behind they sampled (0 when synced)
            metrics["rollout/weight_staleness"] = step - 1 - min(versions)
        stopping, save = _save_due(cfg, step, stop, last_save)
        if save:
            with timer("checkpoint"):  # async: only the copy to CPU (and waiting for the previous save)
                save_checkpoint(run_dir, step, backend, _trainer_state(order, result), cfg.checkpoint.keep_last,
                                blocking=stopping or not cfg.checkpoint.async_save)
            last_save = time.monotonic()
        times = timer.reset()  # the slowest process sets the pace: report its time per phase
        times = dict(zip(times, comm.all_max(list(times.values()))))
        metrics.update(times)
        metrics["tokens/s_generate"] = metrics["tokens/generated"] / max(1e-9, metrics.get("time/generate", 0.0))
        flops = meter.flops(groups, cfg.algo.num_iterations, prepass_forwards)
        metrics.update(meter.measure(flops, metrics.pop("tokens/processed"), times))
        sink.log(step, metrics)
        result.history.append(metrics)
        if main and cfg.log.sample_every_steps and step % cfg.log.sample_every_steps == 0:
            sink.samples(step, [sample_record(step, g) for g in groups[: cfg.log.samples]])
        if stopping:
            sink.close()
            raise Preempted(run_dir, step, stop.requested or "a stop signal on another process")
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.max_steps:
            with timer("eval"):  # counted in the next step's time
                run_eval(f"step {step}")

    sink.close()
    if start < cfg.train.max_steps:  # the final checkpoint makes the finished run resumable/extendable
        save_checkpoint(run_dir, cfg.train.max_steps, backend, _trainer_state(order, result), cfg.checkpoint.keep_last)
    if cfg.eval.after:
        result.eval_after = run_eval("after")
    if cfg.checkpoint.save_final_model:
        backend.export(run_dir / "final", tokenizer)
    engine.close()
    describe_processes(backend, run_dir, say, final=True)
    _summary(say, result, cfg, run_dir)
    return result


def make_meter(cfg: Config, backend, say) -> StepMeter:
    """Throughput/MFU/memory per step: the model's FLOPs per token and one device's peak."""
    hf_config = getattr(backend.module, "config", None)
    described = backend.describe()
    trainable = sum(p.numel() for p in backend.module.parameters() if p.requires_grad) if cfg.model.lora else described["params_total"]
    cost = model_cost(hf_config, described["params_total"], trainable) if hf_config is not None else None
    peak, source = (None, "")
    if comm.is_main():  # one measurement (on CPU), while the others wait: they would compete for the cores
        peak, source = device_peak(backend.device, cfg.train.precision, cfg.log.peak_flops)
    peak, source = comm.broadcast_object((peak, source))
    say(f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({source})" if peak else f"no MFU: {source}")
    local = not (cfg.rollout.engine == "vllm" and cfg.rollout.vllm.mode == "server")
    return StepMeter(cost, peak, MemoryMeter(backend.device), local)


def _save_due(cfg: Config, step: int, stop: StopSignal, last_save: float) -> tuple[bool, bool]:
    """(stop now, save a checkpoint now), the same in every process: a signal may reach only
    some of them, and rank 0's clock decides the time-based saves."""
    c = cfg.checkpoint
    final = step == cfg.train.max_steps  # the end of the run saves anyway
    by_time = bool(c.save_every_minutes) and time.monotonic() - last_save >= 60 * c.save_every_minutes and comm.is_main()
    stopping, by_time = (bool(x) for x in comm.all_max([float(stop.requested is not None), float(by_time)]))
    by_steps = bool(c.save_steps) and step % c.save_steps == 0
    return stopping and not final, not final and (by_steps or by_time or stopping)


def reward_health(rewards: list[BoundReward], sandboxed: bool) -> dict[str, float]:
    """Reward calls that timed out, and the sandbox's executions/seconds/invalid runs, this
    step (the same keys in every process, so they can be summed)."""
    out = {f"reward/{r.name}/timeouts": float(TIMEOUTS.pop(r.name, 0)) for r in rewards}
    out.update({f"reward/{r.name}/seconds": float(REWARD_SECONDS.pop(r.name, 0.0)) for r in rewards})
    REWARD_SECONDS.clear()  # the eval metric's calls are not a reward's cost
    if sandboxed:
        out.update(SANDBOX_STATS.take())
    return out


def step_accuracy(groups: list[Group], metric: BoundReward) -> list[float] | None:
    """The eval metric on this step's completions (reusing its scores when it is also a reward)."""
    has_reference = "tests" in groups[0].prompt.columns if metric.needs_sandbox else groups[0].prompt.answer is not None
    if not has_reference:
        return None
    if metric.name in groups[0].rewards:
        return [v or 0.0 for g in groups for v in g.rewards[metric.name]]
    texts, kwargs = reward_inputs(groups)
    return [v or 0.0 for v in call_reward(metric, texts, kwargs)]


def _trainer_state(order: PromptOrder, result: TrainResult) -> dict:
    per_rank = [int(c) for c in comm.all_gather_objects(order.consumed)]
    return {"prompts_consumed": sum(per_rank), "prompts_consumed_per_rank": per_rank, "eval_before": result.eval_before}


def _summary(say, result: TrainResult, cfg: Config, run_dir: Path) -> None:
    total, shares = phase_summary(result.history)
    say(f"[bold]done[/]: {len(result.history)} steps in {total:.0f}s; time per phase: "
        + ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))
    tip = suggestion(shares, cfg)
    if tip:
        say(f"[bold yellow]suggestion[/]: {tip}")
    say(f"report: `plait report {run_dir}` (HTML + figures); TensorBoard: `tensorboard --logdir {run_dir}`" if cfg.log.tensorboard
        else f"report: `plait report {run_dir}` (HTML + figures)")
    if result.eval_before is not None and result.eval_after is not None:
        say(f"[bold green]{cfg.eval.metric}: {result.eval_before:.3f} before -> {result.eval_after:.3f} after[/]")
    if cfg.checkpoint.save_final_model:
        say(f"model saved to {run_dir / 'final'} (load it with transformers' from_pretrained, or `plait eval {run_dir}`)")
