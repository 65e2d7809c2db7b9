"""The end-of-run suggestion: when one phase dominates the step, what to change first."""

from __future__ import annotations


DOMINANT = 0.5  # a phase above this share of step time gets a suggestion


def _generate(cfg) -> str:
    r = cfg.rollout
    tips = []
    if r.engine == "hf":
        tips.append("rollout.engine=vllm (docs/vllm.md)")
    tips.append(f"a shorter rollout.max_completion_length (now {r.max_completion_length})")
    tips.append(f"fewer rollout.num_generations (now {r.num_generations})")
    return "consider " + ", ".join(tips)


def _train(cfg) -> str:
    t = cfg.train
    tips = []
    # not suggested for CPUs: bf16 autocast there costs learning (config.fast_precision)
    if t.precision == "fp32" and t.device != "cpu":
        tips.append("train.precision=bf16 on a GPU with bf16")
    if cfg.model.gradient_checkpointing:
        tips.append("model.gradient_checkpointing=false if memory allows (it recomputes the forward)")
    tips.append(f"a larger train.micro_batch_size (now {t.micro_batch_size}) if memory allows")
    if cfg.model.lora is None:
        tips.append("model.lora (fewer weight gradients)")
    tips.append("more training processes")
    return "consider " + ", ".join(tips)


SUGGESTIONS = {
    "generate": _generate,
    "train": _train,
    "optimizer": lambda cfg: (
        "the optimizer step: shard it over more processes (train.backend=fsdp2 or deepspeed), "
        "or train LoRA adapters (model.lora)"
    ),
    "score": lambda cfg: (
        "the reward functions: make slow ones async (judges), give them a timeout_s, "
        "or cheapen them (reward/NAME/seconds shows which)"
    ),
    "logprobs": lambda cfg: (
        "the log-prob pre-pass (old-policy and reference log-probs): algo.beta=0 skips the reference, "
        "algo.num_iterations=1 and algo.steps_per_generation=1 skip the old log-probs; "
        "with LoRA the reference is the base model (no second copy)"
    ),
    "weight_sync": lambda cfg: (
        "copying weights to the generation engine: larger rollout.vllm.sync_bucket_mb, "
        "or fewer updates per generation (algo.steps_per_generation)"
    ),
    "checkpoint": lambda cfg: "checkpointing: checkpoint.async_save=true, or a larger checkpoint.save_steps",
    "eval": lambda cfg: "evaluation: a larger eval.every_steps, or fewer eval prompts (data.num_eval)",
    "idle": lambda cfg: "time outside every phase: processes waiting for each other (uneven work), or logging",
}


def suggestion(shares: dict[str, float], cfg) -> str | None:
    """One line about the phase that takes more than half the step, or None."""
    if not shares:
        return None
    phase, share = max(shares.items(), key=lambda kv: kv[1])
    if share < DOMINANT or phase not in SUGGESTIONS:
        return None
    return f"{phase} is {share:.0%} of step time: {SUGGESTIONS[phase](cfg)}"
