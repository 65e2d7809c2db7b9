"""TRL's option names: its defaults where a recipe leaves them out, and the keys that change
nothing in plait. Shared by the recipe converter (config.trl) and the unknown-key hints
(config.load), which must not import each other."""

from __future__ import annotations

from typing import Any


# TRL's defaults for the keys plait converts, where a recipe leaves them out.
TRL_DEFAULTS: dict[str, dict[str, Any]] = {
    "current": {
        "learning_rate": 1e-6,
        "lr_scheduler_type": "linear",
        "num_generations": 8,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_completion_length": 512,
        "beta": 0.0,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "epsilon": 0.2,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "num_iterations": 1,
        "num_train_epochs": 3.0,
        "max_steps": -1,
        "warmup_ratio": 0.0,
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "weight_decay": 0.0,
        "seed": 42,
        "save_strategy": "steps",
        "save_steps": 500,
        "vllm_mode": "colocate",
    },
    # RLOOConfig's own defaults where they differ from GRPOConfig's (`--trainer rloo`)
    "rloo": {
        "beta": 0.05,
        "num_generations": 2,
        "normalize_advantages": False,
    },
    "0.18": {
        "beta": 0.04,
        "loss_type": "bnpo",
        "scale_rewards": True,
        "max_completion_length": 256,
        "max_prompt_length": 512,
        "vllm_mode": "server",
        "vllm_importance_sampling_correction": False,  # TRL added the correction in 0.22
    },
}


# Keys that change nothing a run computes here (logging, hub, evaluation cadence handled by plait...).
NO_EFFECT = {
    "model_revision": "plait loads local folders only",
    "attn_implementation": "plait picks the attention kernel",
    "logging_steps": "plait logs every round (log.every_steps sets the console)",
    "logging_strategy": "plait logs every round",
    "logging_first_step": "plait logs every round",
    "log_level": "no effect",
    "log_completions": "plait always writes samples.jsonl",
    "num_completions_to_print": "plait always writes samples.jsonl",
    "wandb_log_unique_prompts": "no effect",
    "log_unique_prompts": "no effect",
    "report_to": "set log.tensorboard / log.wandb",
    "push_to_hub": "plait pushes nothing to a hub",
    "hub_model_id": "plait pushes nothing to a hub",
    "hub_strategy": "plait pushes nothing to a hub",
    "hub_model_revision": "plait pushes nothing to a hub",
    "push_to_hub_revision": "plait pushes nothing to a hub",
    "overwrite_hub_revision": "plait pushes nothing to a hub",
    "callbacks": "plait has no callbacks",
    "benchmarks": "plait runs no benchmark suites",
    "overwrite_output_dir": "plait never overwrites a run directory (resume=auto continues one)",
    "per_device_eval_batch_size": "eval.batch_size",
    "gradient_checkpointing_kwargs": "plait's checkpointing is non-reentrant",
    "use_liger_kernel": "plait computes log-probs with logits_to_keep and a selective log-softmax",
    "ds3_gather_for_generation": "plait gathers ZeRO-3 weights for generation itself",
    "remove_unused_columns": "plait passes every column to rewards",
    "shuffle_dataset": "data.shuffle",
    "wandb_entity": "log.wandb.entity",
    "wandb_project": "log.wandb.project",
    "wandb_run_group": "no effect",
    "dataset_test_split": "plait evaluates on data.eval_path",
    "do_eval": "plait evaluates on data.eval_path",
    "eval_strategy": "plait evaluates with eval.every_steps on data.eval_path",
}


def trl_option(key: str) -> str | None:
    """What to say of TRL's option `key` written into a plait config (None: TRL has no such
    option plait knows of)."""
    if key in NO_EFFECT:
        return f"'{key}' is a TRL option; in plait: {NO_EFFECT[key]}"
    if key in TRL_DEFAULTS["current"]:
        return (
            f"'{key}' is a TRL option: `plait convert-config RECIPE.yaml` turns a TRL recipe into a plait config "
            "(or `plait train --trl-config RECIPE.yaml` runs it)"
        )
    return None
