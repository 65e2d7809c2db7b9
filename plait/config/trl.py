"""A TRL / Open-R1 GRPO recipe (one flat YAML of GRPOConfig, Open-R1's script arguments and
TRL's ModelConfig) as a plait config.

`convert_recipe` returns the plait config as a nested dict, every recipe key it could not map
with the reason, and notes on what was derived or means something else here. Keys the recipe
leaves out take TRL's defaults where they differ from plait's (learning rate, schedule,
completion length...): those of current TRL, or of TRL 0.18 (`defaults="0.18"`, what
Open-R1's recipes were written for: beta 0.04, loss_type bnpo).

The batch arithmetic follows TRL: per_device_train_batch_size counts completions, and one
optimizer step takes per_device_train_batch_size x processes x gradient_accumulation_steps of
them, i.e. that / num_generations prompts (plait's rollout.prompts_per_step). TRL counts
max_steps and save_steps in optimizer steps, plait in rounds (steps_per_generation x
num_iterations optimizer steps each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from plait.algo.names import LOSS_TYPES
from plait.config.trl_names import NO_EFFECT, TRL_DEFAULTS


# Open-R1's reward names -> plait's built-ins, with the script arguments each takes
# (recipe key, plait kwarg, Open-R1's default).
OPEN_R1_REWARDS: dict[str, tuple[str, list[tuple[str, str, Any]]]] = {
    "accuracy": ("accuracy", []),
    "format": ("think_format", []),
    "tag_count": ("tag_count", []),
    "reasoning_steps": ("reasoning_steps", []),
    "cosine": (
        "cosine_length",
        [
            ("cosine_min_value_wrong", "min_value_wrong", 0.0),
            ("cosine_max_value_wrong", "max_value_wrong", -0.5),
            ("cosine_min_value_correct", "min_value_correct", 0.5),
            ("cosine_max_value_correct", "max_value_correct", 1.0),
            ("cosine_max_len", "max_length", 1000),
        ],
    ),
    "repetition_penalty": (
        "repetition_penalty",
        [("repetition_n_grams", "ngram_size", 3), ("repetition_max_penalty", "max_penalty", -1.0)],
    ),
    "soft_overlong_punishment": (
        "soft_overlong_punishment",
        [("max_completion_len", "max_length", 16384), ("soft_punish_cache", "cache", 4096)],
    ),
}
REWARD_NOTES = {
    "format": "Open-R1's format reward wants exact newlines around the tags; plait's think_format allows any "
    "whitespace there",
    "cosine": "cosine_max_len counts characters in Open-R1 and tokens in plait's cosine_length (same number kept)",
}
UNSUPPORTED_REWARDS = {
    "length": "Kimi 1.5's length reward is not built in (give yours as module:function)",
    "code": "Open-R1 runs verification_info stdin/stdout cases on E2B/Morph; plait's code_pass runs assert tests "
    "from a `tests` column in its local sandbox (docs/sandbox.md)",
    "binary_code": "as for code: plait's code_pass runs assert tests from a `tests` column",
    "ioi_code": "IOI scoring (Piston) is not built in",
    "cf_code": "Codeforces scoring (Piston) is not built in",
    "code_format": "not built in",
}

CODE_KEYS = (
    "code_language",
    "code_eval_test_batch_size",
    "code_eval_scoring_mode",
    "parallel_code_exec_per_proc",
    "code_provider",
    "ioi_provider",
    "e2b_router_url",
    "morph_router_url",
    "enforce_same_language",
)
SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
    "cosine_with_min_lr": "cosine",
}


@dataclass
class Conversion:
    config: dict[str, Any] = field(default_factory=dict)  # plait's, nested
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # recipe key, value, why
    notes: list[str] = field(default_factory=list)
    ignored: list[tuple[str, Any, str]] = field(default_factory=list)  # keys that change nothing here

    def set(self, dotted: str, value: Any) -> None:
        node = self.config
        *path, last = dotted.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value


def _ceil_div(a: float, b: float) -> int:
    return max(1, math.ceil(a / b))


TRAINERS = ("grpo", "rloo")  # the TRL trainers whose recipes convert


def convert_recipe(
    recipe: dict[str, Any],
    processes: int = 1,
    defaults: str = "current",
    dataset_rows: int | None = None,
    trainer: str = "grpo",
) -> Conversion:
    """`recipe` as plait config. `processes`: the training processes TRL would run on (its
    world size, which enters the batch arithmetic); `dataset_rows`: the training rows, needed
    only to turn num_train_epochs into rounds; `trainer`: the TRL trainer the recipe is for
    (GRPOTrainer, or RLOOTrainer with its own defaults and advantages)."""
    if defaults not in TRL_DEFAULTS or defaults == "rloo":
        raise ValueError(f"defaults must be one of current, 0.18, got {defaults!r}")
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, got {trainer!r}")
    base = {**TRL_DEFAULTS["current"], **(TRL_DEFAULTS[defaults] if defaults != "current" else {})}
    if trainer == "rloo":
        base.update(TRL_DEFAULTS["rloo"])
    out = Conversion()
    used: set[str] = set()
    read: list[str] = []  # the keys in the order read: the last one names a value that does not convert

    def get(key: str, default: Any = None) -> Any:
        used.add(key)
        read.append(key)
        return recipe.get(key, base.get(key, default))

    def given(key: str) -> bool:
        used.add(key)
        read.append(key)
        return key in recipe and recipe[key] is not None

    def unmapped(key: str, why: str) -> None:
        used.add(key)
        if key in recipe:
            out.unmapped.append((key, recipe[key], why))

    try:
        _model(recipe, get, given, unmapped, out)
        _data(recipe, get, given, unmapped, out)
        rounds_per_epoch = _batch(recipe, get, given, unmapped, out, processes, dataset_rows)
        _optimizer(recipe, get, given, unmapped, out, rounds_per_epoch)
        (_rloo_algorithm if trainer == "rloo" else _algorithm)(recipe, get, given, unmapped, out)
        _sampling(recipe, get, given, unmapped, out)
        _rewards(recipe, get, given, unmapped, out)
    except (TypeError, ValueError) as err:  # a value of the wrong kind: "abc" for learning_rate
        from plait.config.schema import ConfigError

        if isinstance(err, ConfigError):
            raise
        key = read[-1] if read else "?"
        raise ConfigError(
            [f"TRL recipe: {key}: {recipe.get(key)!r} could not be read ({err}); give it as TRL's config types it"]
        ) from None
    for key, why in NO_EFFECT.items():
        used.add(key)
        if key in recipe:
            out.ignored.append((key, recipe[key], why))
    for key in recipe:
        if key not in used:
            out.unmapped.append((key, recipe[key], f"not a {trainer.upper()} recipe key plait knows"))
    out.set("eval.before", False)  # TRL's recipes evaluate on a test split; plait needs data.eval_path
    out.set("eval.after", False)
    return out


def _model(recipe, get, given, unmapped, out: Conversion) -> None:
    if given("model_name_or_path"):
        out.set("model.name_or_path", recipe["model_name_or_path"])
    dtype = recipe.get("torch_dtype", recipe.get("dtype"))
    used_key = "torch_dtype" if "torch_dtype" in recipe else "dtype"
    get(used_key)
    if dtype in ("bfloat16", "float32"):
        out.set("model.dtype", dtype)
    elif dtype not in (None, "auto"):
        unmapped(used_key, "plait stores weights in float32 or bfloat16")
    if get("trust_remote_code", False):
        unmapped("trust_remote_code", "plait loads transformers' own architectures only")
    if given("gradient_checkpointing"):
        out.set("model.gradient_checkpointing", bool(recipe["gradient_checkpointing"]))
    if get("use_peft", False):
        lora = {"r": get("lora_r", 16), "alpha": get("lora_alpha", 32), "dropout": get("lora_dropout", 0.05)}
        if given("lora_target_modules"):
            lora["target_modules"] = recipe["lora_target_modules"]
        out.set("model.lora", lora)
    for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_task_type"):
        get(key)
    for key in (
        "load_in_4bit",
        "load_in_8bit",
        "use_rslora",
        "use_dora",
        "lora_modules_to_save",
        "use_bnb_nested_quant",
    ):
        if recipe.get(key):
            unmapped(key, "not supported by plait")
        else:
            get(key)
    if given("output_dir"):
        out.set("output_dir", recipe["output_dir"])
    out.set("seed", get("seed"))


def _data(recipe, get, given, unmapped, out: Conversion) -> None:
    if given("dataset_name"):
        out.set("data.task", None)
        out.set("data.path", recipe["dataset_name"])
    if get("dataset_config") is not None:
        unmapped("dataset_config", "give the folder of that configuration as dataset_name")
    if given("dataset_mixture"):
        unmapped("dataset_mixture", "plait reads one dataset: write the mixture to one folder or JSONL first")
    if given("dataset_train_split"):
        out.set("data.split", recipe["dataset_train_split"])
    column = get("dataset_prompt_column")
    # Open-R1's make_conversation: [system?, user: row[column]] as the prompt, conversational
    if column is not None or given("system_prompt") or "reward_funcs" in recipe:
        out.set("data.prompt_field", column or "prompt")
        out.set("data.conversational", True)
    if given("system_prompt"):
        out.set("data.system_prompt", recipe["system_prompt"])
    if given("chat_template"):
        out.set("data.chat_template", recipe["chat_template"])
    if given("max_prompt_length"):
        out.set("data.max_prompt_length", int(recipe["max_prompt_length"]))
        out.notes.append(
            "max_prompt_length: TRL cut longer prompts to their last tokens; plait drops them and says how many "
            "(data.overlong_prompts=error refuses instead)"
        )


def _batch(recipe, get, given, unmapped, out: Conversion, processes: int, rows: int | None) -> float | None:
    """prompts_per_step, micro-batch, accumulation and steps_per_generation; returns the rounds
    of one epoch (None when the number of rows is unknown)."""
    n = int(get("num_generations"))
    per_device = int(get("per_device_train_batch_size"))
    accum = int(get("gradient_accumulation_steps"))
    per_update = per_device * processes * accum
    if per_update % n:
        out.notes.append(
            f"per_device_train_batch_size x processes x gradient_accumulation_steps = {per_update} completions is "
            f"not a multiple of num_generations={n} (TRL refuses this too); rounded down to whole groups"
        )
    prompts = max(1, per_update // n)
    spg = 1
    if given("steps_per_generation") or given("generation_batch_size"):
        micro = (
            int(recipe["steps_per_generation"])
            if given("steps_per_generation")
            else int(recipe["generation_batch_size"]) // (per_device * processes)
        )
        if micro % accum:
            unmapped(
                "steps_per_generation" if "steps_per_generation" in recipe else "generation_batch_size",
                f"a generation round of {micro} micro-steps is not a whole number of optimizer steps "
                f"(gradient_accumulation_steps={accum})",
            )
        else:
            spg = micro // accum
            out.set("algo.steps_per_generation", spg)
    out.set("rollout.num_generations", n)
    out.set("rollout.prompts_per_step", prompts)
    out.set("train.micro_batch_size", per_device)
    out.set("train.gradient_accumulation_steps", accum)
    out.notes.append(
        f"batch: {per_device} completions x {processes} process(es) x {accum} accumulation = {per_update} "
        f"completions per optimizer step"
        + (" = " if prompts * n == per_update else f", {prompts * n} in whole groups = ")
        + f"{prompts} prompts x {n} generations (rollout.prompts_per_step)"
    )
    iters = int(get("num_iterations"))
    if iters != 1:
        out.set("algo.num_iterations", iters)
    per_round = spg * iters  # optimizer steps per round
    max_steps = int(get("max_steps"))
    rounds_per_epoch = None if rows is None else rows / (prompts * spg)
    if max_steps > 0:
        out.set("train.max_steps", _ceil_div(max_steps, per_round))
        if per_round > 1:
            out.notes.append(f"max_steps={max_steps} optimizer steps = {_ceil_div(max_steps, per_round)} rounds")
    else:
        epochs = float(get("num_train_epochs"))
        if rounds_per_epoch is None:
            out.unmapped.append(
                ("num_train_epochs", epochs, "the dataset could not be read to count its rows: set train.max_steps")
            )
        else:
            out.set("train.max_steps", _ceil_div(epochs * rows, prompts * spg))
            out.notes.append(
                f"num_train_epochs={epochs:g} over {rows} rows at {prompts * spg} prompts a round = "
                f"{_ceil_div(epochs * rows, prompts * spg)} rounds (train.max_steps)"
            )
    return rounds_per_epoch


def _optimizer(recipe, get, given, unmapped, out: Conversion, rounds_per_epoch: float | None) -> None:
    out.set("train.learning_rate", float(get("learning_rate")))
    out.set("train.lr_by_signal", False)  # TRL's rate is every update's, whatever share of it teaches
    kind = get("lr_scheduler_type")
    if kind in SCHEDULES:
        out.set("train.lr_scheduler", SCHEDULES[kind])
        out.set("train.decay_ratio", 1.0)  # transformers' schedules decay over every update after warmup
    else:
        unmapped("lr_scheduler_type", f"plait's schedules: {', '.join(SCHEDULES)}")
    kwargs = get("lr_scheduler_kwargs") or {}
    if kind == "cosine_with_min_lr" and "min_lr_rate" in kwargs:
        out.set("train.min_lr_ratio", float(kwargs["min_lr_rate"]))
    elif kwargs:
        unmapped("lr_scheduler_kwargs", "only cosine_with_min_lr's min_lr_rate has a plait equivalent")
    cfg = out.config
    rounds = cfg.get("train", {}).get("max_steps")
    per_round = cfg.get("algo", {}).get("steps_per_generation", 1) * cfg.get("algo", {}).get("num_iterations", 1)
    warmup = int(get("warmup_steps"))
    ratio = float(get("warmup_ratio"))
    if warmup > 0:
        out.set("train.warmup_steps", warmup)
    elif ratio > 0 and rounds is not None:
        steps = math.ceil(ratio * rounds * per_round)
        out.set("train.warmup_steps", steps)
        out.notes.append(f"warmup_ratio={ratio:g} of {rounds * per_round} optimizer steps = {steps} warmup steps")
    elif ratio > 0:
        unmapped("warmup_ratio", "a share of an unknown number of steps: set train.warmup_steps")
    else:
        out.set("train.warmup_steps", 0)
    out.set("train.max_grad_norm", get("max_grad_norm"))
    out.set("train.weight_decay", float(get("weight_decay")))
    for key in ("adam_beta1", "adam_beta2"):
        if given(key):
            out.set(f"train.{key}", float(recipe[key]))
    if get("optim", "adamw_torch") not in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
        unmapped("optim", "plait uses torch's AdamW")
    if given("bf16"):
        out.set("train.precision", "bf16" if recipe["bf16"] else "fp32")
    if get("fp16", False):
        unmapped("fp16", "plait trains in fp32 or bf16")
    _saving(recipe, get, given, unmapped, out, rounds_per_epoch, per_round)


def _saving(recipe, get, given, unmapped, out, rounds_per_epoch, per_round: int) -> None:
    strategy = get("save_strategy")
    steps = get("save_steps")
    if strategy == "no":
        out.set("checkpoint.save_steps", 0)
    elif strategy == "epoch":
        if rounds_per_epoch is None:
            unmapped("save_strategy", "the dataset could not be read to count an epoch's rounds")
        else:
            out.set("checkpoint.save_steps", max(1, math.floor(rounds_per_epoch)))
    elif given("save_steps"):
        rounds = out.config.get("train", {}).get("max_steps")
        if isinstance(steps, float) and steps < 1:
            if rounds is None:
                unmapped("save_steps", "a fraction of an unknown number of steps")
            else:
                out.set("checkpoint.save_steps", max(1, round(steps * rounds)))
        else:
            out.set("checkpoint.save_steps", _ceil_div(float(steps), per_round))
    if given("save_total_limit"):
        out.set("checkpoint.keep_last", max(1, int(recipe["save_total_limit"])))


def _algorithm(recipe, get, given, unmapped, out: Conversion) -> None:
    loss = get("loss_type")
    if loss in LOSS_TYPES:
        out.set("algo.loss_type", loss)
    else:
        unmapped("loss_type", f"plait's loss types: {', '.join(LOSS_TYPES)}")
    out.set("algo.beta", float(get("beta")))
    scale = get("scale_rewards")
    out.set("algo.scale_rewards", {True: "group", False: "none"}.get(scale, scale))
    out.set("algo.epsilon", float(get("epsilon")))
    high = recipe.get("epsilon_high")
    get("epsilon_high")
    if loss == "cispo":
        # TRL caps the weight at epsilon_high itself (epsilon when unset); plait's cispo_cap is that number
        cap = float(high if high is not None else get("epsilon"))
        out.set("algo.cispo_cap", cap)
        out.notes.append(f"cispo: TRL's cap epsilon_high={cap:g} is plait's algo.cispo_cap={cap:g}")
    elif high is not None:
        out.set("algo.epsilon_high", float(high))
    for key in ("delta", "importance_sampling_level", "mask_truncated_completions", "top_entropy_quantile"):
        if given(key):
            out.set(f"algo.{key}", recipe[key])
    if given("entropy_coef") and recipe["entropy_coef"]:
        out.set("algo.entropy_coeff", float(recipe["entropy_coef"]))
        if loss in ("grpo", "dr_grpo"):
            out.notes.append(
                f"entropy_coef with loss_type={loss}: TRL takes the bonus as a token mean, plait aggregates it "
                "like the loss (docs/algorithms.md)"
            )
    if get("use_adaptive_entropy", False):
        unmapped("use_adaptive_entropy", "plait's entropy bonus has a fixed coefficient")
    if get("use_bias_correction_kl", False):
        out.set("algo.kl_bias_correction", True)
    _reference_sync(get, out)
    if given("multi_objective_aggregation"):
        out.set("algo.reward_aggregation", recipe["multi_objective_aggregation"])
    if get("off_policy_mask_threshold") is not None:
        unmapped("off_policy_mask_threshold", "plait has no off-policy sequence mask")


def _reference_sync(get, out: Conversion) -> None:
    """sync_ref_model's steps and mixing weight (read either way: they are known keys)."""
    if get("sync_ref_model", False):
        out.set("algo.ref_model_sync_steps", int(get("ref_model_sync_steps", 512)))
        out.set("algo.ref_model_mixup_alpha", float(get("ref_model_mixup_alpha", 0.6)))
    else:
        get("ref_model_sync_steps")
        get("ref_model_mixup_alpha")


def _rloo_algorithm(recipe, get, given, unmapped, out: Conversion) -> None:
    """RLOOTrainer: leave-one-out advantages, optionally whitened over the batch, and the KL to
    the reference as a k1 penalty in the reward (summed over the completion)."""
    out.set("algo.advantage_estimator", "rloo")
    out.set("algo.scale_rewards", "batch" if get("normalize_advantages") else "none")
    beta = float(get("beta"))
    out.set("algo.beta", beta)
    if beta > 0:
        out.set("algo.kl_in_reward", True)
        out.set("algo.kl_estimator", "k1")
    out.set("algo.epsilon", float(get("epsilon")))
    if given("epsilon_high"):
        out.set("algo.epsilon_high", float(recipe["epsilon_high"]))
    # RLOO's objective clips one ratio per completion, exp(sum of the token log-ratios); plait
    # clips per token. dr_grpo sums each completion's tokens as RLOO does, over a constant
    out.set("algo.loss_type", "dr_grpo")
    out.notes.append(
        "RLOO's loss clips one ratio per completion over its summed log-probs; plait's loss_type=dr_grpo clips "
        "per token and divides by max_completion_length where RLOO divides by 1: on a first pass (num_iterations "
        "1) the same gradient direction, 1/max_completion_length as large (Adam undoes the scale, max_grad_norm "
        "clipping does not)"
    )
    if given("mask_truncated_completions"):
        out.set("algo.mask_truncated_completions", recipe["mask_truncated_completions"])
    if given("reward_clip_range"):
        unmapped("reward_clip_range", "plait does not clip rewards; clamp inside the reward function")
    _reference_sync(get, out)


def _sampling(recipe, get, given, unmapped, out: Conversion) -> None:
    out.set("rollout.max_completion_length", int(get("max_completion_length")))
    out.set("rollout.temperature", float(get("temperature")))
    out.set("rollout.top_p", float(get("top_p")))
    top_k = get("top_k")
    out.set("rollout.top_k", 0 if top_k in (None, -1) else int(top_k))
    if get("min_p") is not None:
        unmapped("min_p", "plait samples with temperature, top_p and top_k")
    if get("repetition_penalty", 1.0) not in (1.0, None):
        unmapped("repetition_penalty", "plait's sampling has no repetition penalty (the reward of that name differs)")
    if given("generation_kwargs"):
        unmapped("generation_kwargs", "set rollout.* options instead")
    if get("use_vllm", False):
        out.set("rollout.engine", "vllm")
        mode = get("vllm_mode")
        out.set("rollout.vllm.mode", mode)
        if mode == "server":
            host = get("vllm_server_host", "0.0.0.0")
            url = get("vllm_server_base_url") or f"http://{'localhost' if host == '0.0.0.0' else host}:"
            if not get("vllm_server_base_url"):
                url += str(get("vllm_server_port", 8000))
            out.set("rollout.vllm.servers", [url])
            out.notes.append(f"vllm_mode=server: start it with `plait rollout-server` ({url}); see docs/vllm.md")
    for key, target in (
        ("vllm_gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization"),
        ("vllm_tensor_parallel_size", "rollout.vllm.tensor_parallel_size"),
        ("vllm_max_model_length", "rollout.vllm.max_model_len"),
        ("vllm_enable_sleep_mode", "rollout.vllm.sleep_between_steps"),
    ):
        if given(key) and recipe.get("use_vllm"):
            out.set(target, recipe[key])
    if recipe.get("use_vllm"):
        correction = get("vllm_importance_sampling_correction", True)
        out.set("algo.engine_is_correction", bool(correction))
        # TRL's defaults where the recipe says nothing: sequence_mask, clip_max 3.0, no clip_min
        out.set("algo.engine_is_mode", get("vllm_importance_sampling_mode", "sequence_mask"))
        cap = get("vllm_importance_sampling_cap")  # the deprecated name wins where given, as in GRPOConfig
        if cap is None:  # clip_max given as None: no upper bound (mask modes)
            cap = get("vllm_importance_sampling_clip_max", 3.0)
        out.set("algo.engine_is_cap", cap)
        out.set("algo.engine_is_min", get("vllm_importance_sampling_clip_min"))
    for key in ("vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_timeout", "vllm_mode"):
        get(key)
    if recipe.get("vllm_device") is not None:
        unmapped("vllm_device", "an old TRL key (ignored by TRL 0.18 too)")


def _rewards(recipe, get, given, unmapped, out: Conversion) -> None:
    names = list(get("reward_funcs", ["accuracy", "format", "tag_count"]) or [])
    weights = list(get("reward_weights") or [1.0] * len(names))
    if len(weights) != len(names):
        unmapped("reward_weights", f"{len(weights)} weights for {len(names)} reward functions")
        weights = [1.0] * len(names)
    specs = []
    for name, weight in zip(names, weights):
        if ":" in name:  # the user's own, as module:function
            specs.append({"name": name, "weight": float(weight)})
        elif name in OPEN_R1_REWARDS:
            plait_name, params = OPEN_R1_REWARDS[name]
            spec = {"name": plait_name, "weight": float(weight)}
            kwargs = {kwarg: get(key, default) for key, kwarg, default in params}
            if kwargs:
                spec["kwargs"] = kwargs
            specs.append(spec)
            if name in REWARD_NOTES:
                out.notes.append(f"reward {name}: {REWARD_NOTES[name]}")
        elif "." in name:  # TRL's script imports "package.module.function"
            module, _, function = name.rpartition(".")
            specs.append({"name": f"{module}:{function}", "weight": float(weight)})
            out.notes.append(f"reward {name}: imported as {module}:{function}, as TRL's script imports it")
        else:
            why = UNSUPPORTED_REWARDS.get(name, "no reward of that name in Open-R1's registry or plait")
            out.unmapped.append((f"reward_funcs: {name}", weight, why))
    if specs:
        out.set("rewards", specs)
    if any(n in names for n in ("accuracy", "cosine", "length")):
        out.set("data.answer_field", "solution")  # Open-R1's accuracy and cosine read the `solution` column
    for key in CODE_KEYS:
        unmapped(key, "configures Open-R1's code rewards, which plait does not have")


def recipe_to_config(path, processes: int = 1, defaults: str = "current", trainer: str = "grpo") -> Conversion:
    """convert_recipe of the YAML file at `path`; when the recipe gives epochs (or saves per
    epoch), the dataset's rows are counted to turn them into rounds."""
    from pathlib import Path

    from plait.config.load import read_yaml
    from plait.config.schema import ConfigError, DataConfig

    recipe = read_yaml(Path(path))
    if not isinstance(recipe, dict):
        raise ConfigError([f"recipe '{path}' must hold a mapping at the top level"])
    out = convert_recipe(recipe, processes, defaults, trainer=trainer)
    wants_rows = any(key == "num_train_epochs" for key, _, _ in out.unmapped) or (
        recipe.get("save_strategy") == "epoch"
    )
    data = out.config.get("data", {})
    if wants_rows and data.get("path"):
        from plait.data import DataError, load_rows

        try:
            rows = len(load_rows(DataConfig.model_validate(data), "train", 0))
        except (DataError, OSError, ValueError) as err:
            out.notes.append(f"the dataset could not be read to count its rows ({err})")
        else:
            out = convert_recipe(recipe, processes, defaults, dataset_rows=rows, trainer=trainer)
    return out


def describe(conv: Conversion) -> str:
    """The notes, the keys that change nothing here, and the keys left out, for the console."""
    lines = [f"note: {n}" for n in conv.notes]
    if conv.ignored:
        lines.append(f"ignored (no effect in plait): {', '.join(k for k, _, _ in conv.ignored)}")
    if conv.unmapped:
        lines.append(f"NOT carried over ({len(conv.unmapped)}); set these yourself if they matter:")
        width = max(len(k) for k, _, _ in conv.unmapped)
        lines += [f"  {k:<{width}} = {_short(v)}: {why}" for k, v, why in conv.unmapped]
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def to_yaml(config: dict, source: str) -> str:
    """The converted config as YAML; multi-line strings (system prompts) as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    body = yaml.dump(config, Dumper=Dumper, sort_keys=False, allow_unicode=True, width=100)
    return f"# converted from {source} by `plait convert-config`\n{body}"
