"""The GRPO training loop. One step, top to bottom:

    prompts -> generate a group per prompt -> score -> group-relative advantages
            -> clipped policy update (num_iterations passes) -> log -> checkpoint

Everything the loop calls is a small function or interface: the rollout engine
(plait.rollout), reward runner (plait.rewards.runner), algorithm (plait.algo, pure tensor
functions), backend (how gradients are computed and applied) and checkpoint store.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from plait.algo.advantages import group_advantages
from plait.algo.logprobs import completion_logprobs
from plait.algo.losses import StepCounts, policy_loss
from plait.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from plait.config import Config, ConfigError, validate
from plait.data import PromptOrder, build_prompts, load_rows
from plait.evaluate import evaluate
from plait.models import load_model, load_tokenizer, save_model
from plait.plan import BatchPlan
from plait.rewards import resolve_reward
from plait.rewards.runner import BoundReward, bind_rewards, call_reward, reward_inputs, score_groups
from plait.rollout import make_engine
from plait.telemetry import MetricsSink, PhaseTimer
from plait.train.backend import LocalBackend, resolve_device
from plait.train.batch import collate, micro_batches
from plait.train.metrics import phase_summary, rollout_metrics, sample_record
from plait.train.optim import make_optimizer
from plait.types import Batch, Group, SamplingParams


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
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
    """The run directory, and the checkpoint to resume from (None for a fresh start)."""
    if cfg.resume not in ("never", "auto"):
        given = Path(cfg.resume)
        ckpt = given if given.name.startswith("step_") else latest_checkpoint(given)
        return ckpt.parent.parent, ckpt
    run_dir = Path(cfg.output_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    existing = latest_checkpoint(run_dir)
    if existing is not None and cfg.resume == "never":
        raise ConfigError(
            [f"output_dir '{run_dir}' already holds checkpoints (newest: {existing.name}); "
             f"continue it with `plait train --resume {run_dir}`, or choose another output_dir"]
        )
    return run_dir, existing if cfg.resume == "auto" else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sampling_params(cfg: Config, step: int) -> SamplingParams:
    """Step `step`'s sampling: its own seed, so a resumed run draws the same completions."""
    r = cfg.rollout
    return SamplingParams(r.max_completion_length, r.temperature, r.top_p, r.top_k, list(r.stop), seed=cfg.seed * 1_000_003 + step)


# ---------------------------------------------------------------- the policy update


def reference_logprobs(model, ref_model, mb: Batch, temperature: float) -> torch.Tensor:
    """log-probs under the frozen reference: a separate copy, or the base model under LoRA."""
    ctx = model.disable_adapter() if ref_model is None else nullcontext()
    with ctx:
        return completion_logprobs(ref_model or model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature)


def policy_update(model, ref_model, batch: Batch, cfg: Config, backend, optimizer, scheduler) -> dict[str, float]:
    """num_iterations optimizer steps on one generation batch, accumulating over micro-batches."""
    a = cfg.algo
    temperature = cfg.rollout.temperature or 1.0
    mbs = [mb.to(backend.device) for mb in micro_batches(batch, cfg.train.micro_batch_size)]
    seqs, toks = backend.all_sum([len(batch), float(batch.completion_mask.sum())])
    counts = StepCounts(int(seqs), int(toks), len(mbs), cfg.rollout.max_completion_length)

    with torch.no_grad(), backend.autocast():
        for mb in mbs:
            if a.num_iterations > 1:  # the policy that sampled; with one pass it equals logp itself
                mb.old_logprobs = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature).float()
            if a.beta > 0:
                mb.ref_logprobs = reference_logprobs(model, ref_model, mb, temperature).float()

    sums: dict[str, float] = defaultdict(float)
    for _ in range(a.num_iterations):
        for mb in mbs:
            with backend.autocast():
                logp = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature).float()
            old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
            loss, parts = policy_loss(
                logp, old, mb.advantages, mb.completion_mask, counts, a.loss_type, a.epsilon, a.epsilon_high, a.beta, mb.ref_logprobs
            )
            loss.backward()
            gap = ((logp.detach() - mb.sampling_logprobs).abs() * mb.completion_mask).sum()
            # one device->host sync per micro-batch, not one per number
            values = torch.stack([loss.detach(), gap, *parts.values()]).tolist()
            sums["loss"] += values[0]
            sums["logprob_gap_tokens"] += values[1]
            for k, v in zip(parts, values[2:]):
                sums[k] += v
        sums["grad_norm"] += backend.clip_and_step(model, optimizer, cfg.train.max_grad_norm)
        sums["lr"] += scheduler.get_last_lr()[0]
        scheduler.step()

    n, tokens = a.num_iterations, max(1.0, toks * a.num_iterations)
    out = {"loss": sums["loss"] / n, "grad_norm": sums["grad_norm"] / n, "lr": sums["lr"] / n}
    out["clip/low"] = sums["clip_low_tokens"] / tokens
    out["clip/high"] = sums["clip_high_tokens"] / tokens
    out["clip/fraction"] = out["clip/low"] + out["clip/high"]
    out["logprob_gap"] = sums["logprob_gap_tokens"] / tokens  # engine vs trainer, mean |diff|
    if a.beta > 0:
        out["kl"] = sums["kl_tokens"] / tokens
    return out


# ---------------------------------------------------------------- the loop


def train(cfg: Config, console: str | None = None) -> TrainResult:
    plan = validate(cfg)  # every config problem, before anything heavy loads
    run_dir, resume_from = prepare_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    sink = MetricsSink(None, cfg.train.max_steps, console or cfg.log.console)
    cfg = apply_plan(cfg, plan, sink.print)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.seed)
    say = sink.print
    say(f"[bold]plait[/] run dir {run_dir}  |  {plan.prompts_per_step} prompts x {plan.num_generations} generations, "
        f"micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps} accumulation")

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    train_prompts = build_prompts(load_rows(cfg.data, "train", cfg.seed), tokenizer, cfg.data, log=say)
    evaluating = cfg.eval.before or cfg.eval.after or cfg.eval.every_steps
    eval_prompts = build_prompts(load_rows(cfg.data, "eval", cfg.seed), tokenizer, cfg.data, log=say) if evaluating else []
    device = resolve_device(cfg.train.device)
    model = load_model(cfg.model.name_or_path, cfg.model.dtype, cfg.model.lora, cfg.model.gradient_checkpointing).to(device)
    model.train()
    # beta = 0 loads no reference model; with LoRA the reference is the base model itself
    ref_model = None
    if cfg.algo.beta > 0 and cfg.model.lora is None:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    engine = make_engine(cfg, model, tokenizer)
    rewards = bind_rewards(cfg.rewards)
    metric = BoundReward(cfg.eval.metric, resolve_reward(cfg.eval.metric))
    optimizer, scheduler = make_optimizer(model, cfg)
    backend = LocalBackend(cfg.train.precision, device)
    order = PromptOrder(len(train_prompts), cfg.seed, cfg.data.shuffle)
    pad_id = engine.pad_id

    start, result = 0, TrainResult(run_dir, cfg.train.max_steps)
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler)
        start, order.consumed = state["step"], state["prompts_consumed"]
        result.eval_before = state.get("eval_before")
        say(f"resumed from {resume_from} (step {start}, {order.consumed} prompts consumed)")
    eval_tokens = cfg.eval.max_completion_length or cfg.rollout.max_completion_length

    def run_eval(tag: str) -> float:
        res = evaluate(engine, eval_prompts, metric, eval_tokens, cfg.rollout.stop)
        say(f"[bold cyan]eval {tag}[/]: {cfg.eval.metric} = {res.accuracy:.3f} on {res.n} held-out prompts (greedy)")
        with (run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps({"tag": tag, "step": step, cfg.eval.metric: res.accuracy, "n": res.n}) + "\n")
        return res.accuracy

    step = start
    if cfg.eval.before and start == 0:
        result.eval_before = run_eval("before")

    sink.path = run_dir / "metrics.jsonl"
    if sink.progress is not None:
        sink.progress.update(sink.task, completed=start)
    timer = PhaseTimer()
    for step in range(start + 1, cfg.train.max_steps + 1):
        prompts = [train_prompts[i] for i in order.take(plan.prompts_per_step)]
        with timer("generate"):
            completions = engine.generate(prompts, sampling_params(cfg, step), n=plan.num_generations)
        groups = [Group(p, cs) for p, cs in zip(prompts, completions)]
        with timer("score"):
            score_groups(groups, rewards)  # raises RewardError naming the function and sample
            texts, kwargs = reward_inputs(groups)
            accuracy = [v or 0.0 for v in call_reward(metric, texts, kwargs)] if prompts[0].answer is not None else None
        totals = torch.tensor([g.total for g in groups], dtype=torch.float32)
        advantages = group_advantages(totals, cfg.algo.scale_rewards)
        batch = collate(groups, advantages, pad_id, cfg.algo.mask_truncated_completions)
        with timer("train"):
            update = policy_update(model, ref_model, batch, cfg, backend, optimizer, scheduler)

        metrics = {**rollout_metrics(groups, accuracy), **update}
        if cfg.checkpoint.save_steps and step % cfg.checkpoint.save_steps == 0 and step < cfg.train.max_steps:
            with timer("checkpoint"):
                save_checkpoint(run_dir, step, model, optimizer, scheduler, _trainer_state(order, result), cfg.checkpoint.keep_last)
        metrics.update(timer.reset())
        metrics["tokens/s_generate"] = metrics["tokens/generated"] / max(1e-9, metrics["time/generate"])
        sink.log(step, metrics)
        result.history.append(metrics)
        if cfg.log.sample_every_steps and step % cfg.log.sample_every_steps == 0:
            rec = sample_record(step, groups[0])
            with (run_dir / "samples.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
            say(f"[dim]sample @ {step}: {rec['completion'][:160]!r} rewards={rec['rewards']}")
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.max_steps:
            run_eval(f"step {step}")

    sink.close()
    if start < cfg.train.max_steps:  # the final checkpoint makes the finished run resumable/extendable
        save_checkpoint(run_dir, cfg.train.max_steps, model, optimizer, scheduler, _trainer_state(order, result), cfg.checkpoint.keep_last)
    if cfg.eval.after:
        result.eval_after = run_eval("after")
    if cfg.checkpoint.save_final_model:
        save_model(model, tokenizer, run_dir / "final")
    _summary(say, result, cfg, run_dir)
    return result


def _trainer_state(order: PromptOrder, result: TrainResult) -> dict:
    return {"prompts_consumed": order.consumed, "eval_before": result.eval_before}


def _summary(say, result: TrainResult, cfg: Config, run_dir: Path) -> None:
    total, shares = phase_summary(result.history)
    say(f"[bold]done[/]: {len(result.history)} steps in {total:.0f}s; time per phase: "
        + ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))
    if result.eval_before is not None and result.eval_after is not None:
        say(f"[bold green]{cfg.eval.metric}: {result.eval_before:.3f} before -> {result.eval_after:.3f} after[/]")
    if cfg.checkpoint.save_final_model:
        say(f"model saved to {run_dir / 'final'} (load it with transformers' from_pretrained, or `plait eval {run_dir}`)")
