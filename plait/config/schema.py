"""The config tree: one pydantic section per part of a run, with every default and what it means.

Words used in the descriptions: a *round* is one generation batch, one pass of generate ->
score -> train; an *update* is one optimizer step. A round makes
`algo.num_iterations x algo.steps_per_generation` updates. Keys keep the names TRL users know
(`max_steps`, `save_steps`, ...); each description says what it counts.

Choices that name an entry of a table in `plait.algo` take their values from that table, so a
new loss type or KL estimator is one table entry. This module imports nothing from the layers
above it (data, models, rewards, plan, train, rollout).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from plait.algo.names import (
    ENGINE_IS_MODES,
    ESTIMATOR_NAMES,
    IS_LEVELS,
    KL_NAMES,
    LOSS_TYPES,
    REWARD_AGGREGATIONS,
    SCALES,
)


# the keys of the tables, in their order (pydantic lists them in its error messages)
LossType = Literal[tuple(LOSS_TYPES)]
KlEstimator = Literal[KL_NAMES]
ImportanceLevel = Literal[IS_LEVELS]
RewardScale = Literal[SCALES]
RewardAggregation = Literal[REWARD_AGGREGATIONS]
AdvantageEstimator = Literal[ESTIMATOR_NAMES]
EngineIsMode = Literal[ENGINE_IS_MODES]


class ConfigError(ValueError):
    """Raised with every problem found, one per line, before any model is loaded."""

    def __init__(self, problems: list[str], config: "Config | None" = None, replaced: tuple[str, ...] = ()):
        self.problems = list(problems)
        # the config without the keys it names (and with the values it refuses at their defaults,
        # `replaced`), when the rest is valid: later checks still run on it, so that one pass
        # reports every problem (a misspelt key or a value out of range hides nothing behind it)
        self.config = config
        self.replaced = tuple(replaced)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the configuration:\n{lines}")


class Section(BaseModel):
    # allow_inf_nan=False: an inf learning rate or a NaN reward weight would train (or crash) far
    # from the typo; no option means anything by inf (unbounded limits are null)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


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
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype the weights are stored and updated in.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")


class Example(Section):
    prompt: str = Field(..., min_length=1, description="The example's question (a user turn).")
    completion: str = Field(
        ..., min_length=1, description="Its answer, written as the model should answer (the assistant's turn)."
    )
    tool_output: str | None = Field(
        None,
        description="With tools: what the tool returned for the call `completion` ends with (shown as a tool turn, "
        "in rollout.tools.role), so the example also shows the model going on after a tool's output.",
    )
    answer: str | None = Field(
        None, min_length=1, description="With tool_output: the model's turn after it (e.g. the boxed final answer)."
    )

    @model_validator(mode="after")
    def _whole_tool_call(self):
        if (self.tool_output is None) != (self.answer is None):
            raise ValueError(
                "a worked tool call needs both tool_output (what the tool returned) and answer (the model's turn "
                "after it); give both or neither"
            )
        return self


class DataConfig(Section):
    # other trainers' names for these options (veRL's data.train_files, TRL scripts' dataset_name,
    # OpenRLHF's prompt_data and input_key): an unknown key gives plait's name for it (config.load)
    SYNONYMS: ClassVar[dict[str, str]] = {
        **dict.fromkeys(
            "train_files train_file train_path dataset dataset_name dataset_path data_files prompt_data file".split(),
            "path",
        ),
        **dict.fromkeys("val_files val_file eval_file test_file validation_file eval_dataset".split(), "eval_path"),
        **dict.fromkeys("prompt_key input_key prompt_column".split(), "prompt_field"),
        **dict.fromkeys("label_key answer_key answer_column solution_field".split(), "answer_field"),
    }

    task: str | None = Field(
        "arithmetic", description="A built-in task (see `plait tasks`); off (null) when `path` is given."
    )
    path: str | None = Field(None, description="Prompts: a .jsonl/.parquet file or a saved `datasets` folder.")
    format: Literal["auto", "jsonl", "parquet", "disk"] = Field("auto", description="How to read `path`.")
    split: str = Field("train", description="Split to read from a DatasetDict folder.")
    eval_path: str | None = Field(None, description="Held-out prompts for evaluation (same format).")
    prompt_field: str = Field("prompt", description="Column holding the prompt text.")
    messages_field: str | None = Field(None, description="Column holding chat messages (overrides prompt_field).")
    answer_field: str | None = Field("answer", description="Column holding the reference answer.")
    system_prompt: str | None = Field(None, description="System message put before every prompt.")
    examples: list[Example] | None = Field(
        None,
        description="Worked examples [{prompt, completion}] put before every prompt as earlier turns of the "
        "conversation (few-shot), in training and evaluation alike; with tools, an example can also show the tool's "
        "output and the answer after it (tool_output, answer). null = the built-in task's own (arithmetic: two; "
        "multiply: one tool call), none for your own data; [] = none.",
    )
    chat_template: bool | str = Field(
        True, description="Apply the tokenizer's chat template (true), none (false), or this Jinja template instead."
    )
    conversational: bool | None = Field(
        None,
        description="Give reward functions each prompt as chat messages (system prompt included) and each "
        "completion as [{role: assistant, content}], as TRL does for conversational data; false: as strings. "
        "null = when messages_field is set.",
    )
    max_prompt_length: int = Field(256, ge=1, description="Longest prompt in tokens.")
    overlong_prompts: Literal["drop", "error"] = Field(
        "drop", description="What to do with prompts longer than max_prompt_length."
    )
    num_train: int = Field(1000, ge=1, description="Built-in task: number of training problems.")
    num_eval: int = Field(100, ge=1, description="Built-in task: number of held-out problems.")
    shuffle: bool = Field(True, description="Shuffle the prompt order each epoch (seeded).")

    @model_validator(mode="before")
    @classmethod
    def _own_data_replaces_the_task(cls, data: Any) -> Any:
        """`path` given and `task` not: the user's prompts, not the built-in task."""
        if isinstance(data, dict) and data.get("path") is not None and "task" not in data:
            data = {**data, "task": None}
        return data


class VllmSettings(Section):
    mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="colocate: each training process runs its own vLLM engine on its device; server: vLLM runs in "
        "`plait rollout-server` processes on their own devices/nodes, reached over HTTP.",
    )
    servers: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="Server mode: URL of a rollout server (its data-parallel replicas are found from it), "
        "or of each replica.",
    )
    token_file: str | None = Field(
        None,
        description="Server mode: file holding the rollout servers' token (null = ~/.cache/plait/rollout-token, "
        "created by whichever of server and trainer starts first); PLAIT_ROLLOUT_TOKEN overrides it. "
        "See docs/security.md.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Server mode: GPUs per engine replica (`plait rollout-server --tp`)."
    )
    data_parallel_size: int = Field(1, ge=1, description="Server mode: engine replicas (`plait rollout-server --dp`).")
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="GPU memory share vLLM may take (colocate: leave the rest to training)."
    )
    kv_cache_gb: float | None = Field(
        None, gt=0.0, description="KV cache size in GiB (CPU default 1; GPU: overrides gpu_memory_utilization)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + completion (null = max_prompt_length + max_completion_length)."
    )
    max_num_seqs: int = Field(256, ge=1, description="Sequences decoded at once.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of shared prompt prefixes (the group's prompt is prefilled once)."
    )
    enforce_eager: bool | None = Field(
        None, description="No torch.compile / CUDA graphs (null = eager on CPU, compiled on GPU)."
    )
    sleep_between_steps: bool = Field(
        True,
        description="Colocate on GPU: free vLLM's memory while a round trains, wake it for the next "
        "round's generation (sleep/wake).",
    )
    sync_bucket_mb: int = Field(
        512, ge=1, description="Server mode: weights are broadcast in flat buckets of this size."
    )
    sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Server mode weight broadcast: auto = nccl on GPU, gloo on CPU."
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Server mode: a generation or weight sync taking longer fails the round (no silent hang).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments, passed as they are (e.g. {quantization: fp8}).",
    )
    connect_timeout_s: float = Field(
        60.0, gt=0, description="Server mode: how long to wait for the servers to answer at start."
    )


class TwoStageConfig(Section):
    first_generations: int = Field(
        2, ge=1, description="Candidates sampled per prompt first, before deciding whether the prompt gets the rest."
    )
    keep: Literal["mixed", "not_all_correct", "not_all_failed"] = Field(
        "not_all_correct",
        description="Which prompts get the rest of the group: 'mixed' (the first candidates disagree), "
        "'not_all_correct' (skip prompts already solved every time), 'not_all_failed' (skip prompts failed "
        "every time).",
    )
    reward: str | None = Field(
        None, description="The reward that decides correct/failed (default: the first configured reward)."
    )
    threshold: float = Field(1.0, description="A candidate counts as correct when that reward is >= this.")


class ToolsConfig(Section):
    format: Literal["python", "hermes"] = Field(
        "python",
        description="How the model calls a tool: 'python' (a fenced ```python block ends its turn; the block runs "
        'in the sandbox) or \'hermes\' (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, the native '
        "format of Qwen2.5/Qwen3/Hermes chat templates; the tools are described to the model through the template).",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Model turns per completion at most (so at most max_turns - 1 tool turns); every generate call "
        "counts, also one that resumes a turn cut at a stop string without a complete call.",
    )
    python: bool = Field(
        True,
        description="Offer the Python tool: a session in the sandbox whose state lasts across the calls of one "
        "completion (format hermes: a function `python(code)`).",
    )
    functions: list[str] = Field(
        default_factory=list,
        description="Python functions offered as tools, as 'module:function' (format hermes); the schema comes "
        "from the type hints and the docstring, as in TRL.",
    )
    trusted_functions: bool = Field(
        False,
        description="Run `functions` in the trainer's process (your own code, known safe). false = in the sandbox, "
        "from their module's source (standard library imports only).",
    )
    max_output_chars: int = Field(
        1000, ge=16, description="A tool's output (stdout, then stderr) is cut to this many characters."
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one tool call.")
    role: str = Field(
        "tool", description="Chat role of a tool's output ('user' for templates that know no 'tool' role)."
    )
    plain_output: str = Field(
        "```output\n{output}\n```\n",
        description="Without a chat template: the text appended after a call ({output} is the tool's output).",
    )


class AgentConfig(Section):
    function: str = Field(
        description="'module:function': your agent, called once per rollout with a task (its row, and the base URL "
        "and API key of an OpenAI-compatible endpoint that records every token it samples); it may return the "
        "rollout's reward (docs/environments.md)."
    )
    timeout_s: float = Field(
        600.0, gt=0, description="An agent still running this long after its round began is an infrastructure error."
    )
    max_error_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the run when more than this share of a round's agents fail (raise, time out, make no call).",
    )
    host: str = Field(
        "127.0.0.1",
        description="Where the endpoint listens (loopback: agents in this machine's processes; 0.0.0.0: others too, "
        "with the run's token).",
    )
    port: int = Field(0, ge=0, le=65535, description="Its port (0: any free one; each generating process has its own).")


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation engine: 'hf' (transformers, in the training process) or 'vllm'."
    )
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="Options of engine vllm.")
    prompts_per_step: int = Field(
        8,
        ge=1,
        description="Distinct prompts per optimizer update; a round generates for "
        "prompts_per_step x algo.steps_per_generation prompts.",
    )
    num_generations: int = Field(8, ge=1, description="Completions per prompt (the group size).")
    max_completion_length: int = Field(32, ge=1, description="Longest completion in tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Sample among the top k tokens (0 = all).")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings besides EOS.")
    batch_size: int = Field(64, ge=1, description="Sequences per generate call.")
    packed_weights: bool = Field(
        True,
        description="Engine hf, fp32 on CPU: decode through oneDNN-packed copies of the linear weights, made "
        "when a round's generation starts (faster decoding matmuls, for one extra copy of the weights while "
        "generating).",
    )
    cuda_graphs: bool = Field(
        True,
        description="Engine hf on a CUDA GPU: each decoding step replays a captured CUDA graph over a static KV "
        "cache (buckets of rows and length, captured once and again only when the weights' tensors are replaced; "
        "the capture time is logged as rollout/graph_capture_s). false: eager steps. Models with sliding-window "
        "layers decode eagerly.",
    )
    precision: Literal["auto", "fp32", "bf16", "int8"] = Field(
        "auto",
        description="What rollouts are sampled in; the trainer keeps train.precision and recomputes the old "
        "log-probs in it; evaluation decodes in train.precision. auto: fp32 for engine hf on a CPU (the trainer's "
        "exact policy, and one process samples what several do), else train.precision. bf16: on a CPU, packed bf16 "
        "copies of the linear weights (faster with AVX512-BF16 or AMX: the demo's sampling 1.39x on a Zen 5; several "
        "times slower without), elsewhere bf16 autocast (vLLM: dtype bfloat16). int8: engine hf on a CPU, int8 "
        "weights and activations through fbgemm: faster "
        "sampling with VNNI, but log-probs far from the trainer's (docs/vs-trl.md); slower than fp32 and far worse "
        "learning on an AVX2-only CPU (7-bit activations); algo.engine_is_correction defaults to on with it. "
        "vLLM quantizes with rollout.vllm.engine_kwargs: {quantization: fp8}.",
    )
    lora_push: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="With model.lora and an engine that does not sample from the trainer's own model (vLLM, "
        "colocated or on rollout servers; the HF engine's generation process): send it the adapter alone each round "
        "(vLLM loads it with its own LoRA support, rank up to 512; the HF generation process adds B @ A x scale to "
        "its base copy), or the merged weights. auto: the adapter, except to vLLM on CPU, whose LoRA kernels make "
        "sampling several times slower than merged weights do.",
    )
    two_stage: TwoStageConfig | None = Field(
        None,
        description="Sample a few candidates per prompt first; spend the rest of the group only on prompts "
        "that can still teach.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous generation (docs/async.md): round t is generated with the weights after round "
        "max(0, t-1-k) while the trainer trains earlier rounds, so no sample is more than k updates of the policy "
        "old when trained. 0 = generate, then train (synchronous). Needs generation off the training process: "
        "engine hf (a generation process of its own) or engine vllm in server mode.",
    )
    generation_process: bool = Field(
        False,
        description="Engine hf: generate in a process of its own, with its own copy of the weights and its own "
        "threads (always so when max_staleness > 0). With max_staleness 0 the trainer waits for it each round.",
    )
    shared_memory_weights: bool = Field(
        True,
        description="Engine hf in a generation process, on a CPU: each round's weights reach it through a file in "
        "/dev/shm both processes map (one copy each side) instead of a gloo broadcast over a socket.",
    )
    inflight_updates: bool = Field(
        False,
        description="Async, engine hf: new weights reach the generation process as soon as they exist and are "
        "swapped in between two decoding steps (PipelineRL), instead of after the running round; every token "
        "keeps the version of the weights that sampled it. Fresher samples, but not reproducible from the seed.",
    )
    tools: ToolsConfig | None = Field(
        None,
        description="Multi-turn tool use (docs/tools.md): the model's turn stops at a tool call, plait runs it "
        "and appends its output (masked out of the loss), and the model goes on.",
    )
    rollout_func: str | None = Field(
        None,
        description="'module:function': your own rollout loop (TRL's rollout_func), given the prompts and a context "
        "whose generate samples with plait's engine; it returns the completions' token ids, log-probs and an "
        "optional env_mask (docs/environments.md).",
    )
    program: str | None = Field(
        None,
        description="'module:factory': your own rollout program, built once with the run's ProgramSetup; its "
        'run(sampler, prompts, params, n) returns n trajectories per prompt (docs/environments.md, "Write your own '
        "rollout program\"). Null: the program the config's sections choose (agent, rollout_func, tools, or one "
        "sampled answer).",
    )
    agent: AgentConfig | None = Field(
        None,
        description="Any agent program as the rollout: plait serves it an OpenAI-compatible endpoint "
        "(/v1/chat/completions, /v1/completions) and trains on exactly the tokens its calls sampled, linked by "
        "exact prefix (docs/environments.md).",
    )
    generator_threads: int | None = Field(
        None,
        ge=1,
        description="Engine hf on CPU: torch threads of the generation process (null = the cores "
        "train.threads leaves free, at least 1).",
    )
    max_logprob_gap: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        "auto",
        description="Drift guard: a round sampled with the weights it is trained from whose mean |engine - "
        "trainer| log-prob of the sampled tokens (logprob_gap) passes this stops the run before its checkpoint: "
        "the engine does not hold the trainer's weights. auto = 0.01 in fp32, 0.5 in bf16, 2 with int8 rollouts "
        "(the coarser of rollout.precision and train.precision decides); null = off. Rounds sampled with older weights "
        "by design (max_staleness >= 1, in-flight updates) are not checked.",
    )


class RewardSpec(Section):
    name: str = Field(
        description="A built-in reward (see `plait rewards`), 'module:function' or 'path/to/file.py:function'."
    )
    weight: float = Field(1.0, description="Weight in the summed reward.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the reward.")
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="Time limit for one call over the completions scored together (a round's, or "
        "one sampling batch's); past it the reward is None (excluded) for them, with a warning.",
    )
    process: bool | None = Field(
        None,
        description="Run it in a process of its own, on that process's main thread (signal-based time "
        "limits such as math-verify's work; a call past timeout_s is killed). null = yes for sync "
        "functions from your own modules, no for built-ins, async functions and sandboxed ones.",
    )


class SandboxConfig(Section):
    min_tier: Literal["process", "namespaces", "seccomp"] = Field(
        "namespaces",
        description="Weakest isolation code rewards may run under; plait refuses to start below it "
        "(see `plait sandbox`).",
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit per execution.")
    cpu_s: int = Field(10, ge=1, description="CPU seconds per process (RLIMIT_CPU).")
    memory_mb: int = Field(
        512, ge=64, description="Address space per process, and total resident memory of an execution."
    )
    max_processes: int = Field(32, ge=1, description="Processes and threads per execution (RLIMIT_NPROC).")
    output_bytes: int = Field(65536, ge=1024, description="stdout/stderr kept per execution; more kills the program.")
    workers: int = Field(2, ge=1, description="Executions run at once.")
    python: str | None = Field(
        None,
        description="Interpreter for the program (default: this Python, or the system python3 when running as root).",
    )


def default_rewards() -> list[RewardSpec]:
    """The demo's: boxed_accuracy is what the evaluation measures; accuracy (the last number
    counts too) gives credit before the model boxes its answers; boxed_format, small, gets the
    box started. A larger format weight, with accuracy as the only other reward, let some seeds
    learn to box wrong answers (`a + b = \\boxed{a}`) and never recover (docs/reproducibility.md)."""
    return [
        RewardSpec(name="accuracy", weight=0.5),
        RewardSpec(name="boxed_accuracy", weight=1.0),
        RewardSpec(name="boxed_format", weight=0.2),
    ]


class AlgoConfig(Section):
    loss_type: LossType = Field(
        "dapo", description=f"Objective + averaging: {', '.join(LOSS_TYPES)} (see docs/algorithms.md)."
    )
    importance_sampling_level: ImportanceLevel = Field(
        "token", description="Importance ratio per token (GRPO) or per sequence (GSPO)."
    )
    advantage_estimator: AdvantageEstimator = Field(
        "grpo",
        description=f"How rewards become advantages: {', '.join(ESTIMATOR_NAMES)} (docs/algorithms.md, 'Advantages').",
    )
    scale_rewards: RewardScale | None = Field(
        None,
        description="Divide the centred rewards by the group std, by the batch std (whiten over the batch), or "
        "nothing; null = the estimator's own (group for grpo, none for rloo and opo, batch for reinforce_pp*).",
    )
    reward_aggregation: RewardAggregation = Field(
        "sum_then_normalize",
        description="Several rewards: weighted sum then normalize (GRPO), or normalize each then sum (GDPO).",
    )
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="Lower clip: ratio >= 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clip (DAPO clip-higher; CISPO's weight cap is 1 + this); null = epsilon."
    )
    cispo_cap: float | None = Field(
        None,
        gt=0.0,
        description="CISPO: cap of the importance weight itself (TRL's epsilon_high for cispo); "
        "null = 1 + epsilon_high (MiniMax-M1's notation).",
    )
    delta: float | None = Field(
        None, gt=1.0, description="Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta; null = off."
    )
    beta: float = Field(0.0, ge=0.0, description="KL coefficient to the reference model (0 = no reference model).")
    kl_estimator: KlEstimator = Field(
        "k3", description=f"Per-token KL estimator: {', '.join(KL_NAMES)} (see plait/algo/kl.py)."
    )
    kl_in_reward: bool = Field(
        False, description="Subtract beta x sequence KL from the reward instead of adding KL to the loss."
    )
    kl_bias_correction: bool = Field(
        False,
        description="Multiply the per-token KL by the importance ratio pi / pi_old (DeepSeek-V3.2; TRL's "
        "use_bias_correction_kl): the KL of the current policy, not of the one that sampled.",
    )
    ref_model_sync_steps: int = Field(
        0,
        ge=0,
        description="Every N applied optimizer updates (skipped non-finite ones don't count), mix the "
        "policy into the reference (0 = frozen).",
    )
    ref_model_mixup_alpha: float = Field(
        0.6, gt=0.0, le=1.0, description="ref <- alpha * policy + (1 - alpha) * ref at each sync."
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Passes over each round's batch (reusing it against the old log-probs); each pass is "
        "steps_per_generation optimizer updates.",
    )
    steps_per_generation: int = Field(
        1,
        ge=1,
        description="Optimizer updates one pass over a round's batch is split into (each on "
        "rollout.prompts_per_step prompts).",
    )
    mask_truncated_completions: bool = Field(False, description="Exclude completions cut at max length from the loss.")
    top_entropy_quantile: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Policy gradient only from this top share of tokens by entropy (1 = all); the KL term "
        "and the normalizers still count every token (arXiv:2506.01939).",
    )
    entropy_coeff: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient (0 = none).")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal and refill with new prompts."
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="Dynamic sampling and two_stage: batches of fresh prompts generated per round at most, "
        "while informative groups are missing.",
    )
    engine_is_correction: bool | None = Field(
        None,
        description="Reweight the policy term by the importance ratio pi_old / pi_engine for the gap between the "
        "engine that sampled and the trainer's weights, as algo.engine_is_mode says (null = on when "
        "rollout.max_staleness > 0, where it is decoupled PPO's behaviour correction).",
    )
    engine_is_mode: EngineIsMode = Field(
        "token_truncate",
        description="token_truncate: each token's ratio clipped to [engine_is_min, engine_is_cap]; token_mask: "
        "tokens whose ratio falls outside left out (with both bounds, IcePop's two-sided mask); "
        "sequence_truncate / sequence_mask: one ratio per completion (the product over its tokens), clipped or "
        "masked alike. TRL's vllm_importance_sampling_mode.",
    )
    engine_is_cap: float | None = Field(
        2.0, gt=0.0, description="Upper bound of the engine-mismatch importance ratio (null = none; mask modes only)."
    )
    engine_is_min: float | None = Field(
        None, ge=0.0, description="Lower bound of the engine-mismatch importance ratio (null = none)."
    )


class TeacherConfig(Section):
    """On-policy distillation: a frozen teacher scores every token the student sampled."""

    # keys users reach for that a frozen teacher has no use for: refused with the reason (config.load)
    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "lora": "the teacher is frozen, so it trains no adapters; LoRA on the student is model.lora, and a "
        "teacher trained with LoRA is its run's final/ (plait exports merged weights)",
    }

    name_or_path: str = Field(
        description="The teacher model: a Hugging Face model folder, a plait run directory (its final/), or a "
        "run's best/. It must use the student's tokenizer (plait check compares the vocabularies)."
    )
    weight: float = Field(
        1.0,
        gt=0.0,
        description="Coefficient of the distillation advantage: weight x (teacher log-prob - student log-prob) on "
        "every sampled token, added to the rewards' advantages (docs/algorithms.md, 'On-policy distillation').",
    )
    site: Literal["trainer", "process", "server"] = Field(
        "trainer",
        description="Where the teacher runs: in every training process, held as the backend holds the reference "
        "(sharded by fsdp2 and ZeRO-3); in a process of its own (its own threads, or train.device's device); or "
        "on a `plait rollout-server --model TEACHER` (vLLM) at teacher.url, which scores with its prompt log-probs.",
    )
    url: str | None = Field(
        None,
        description="teacher.site=server: the server's URL (any replica; the token as for rollout servers: "
        "PLAIT_ROLLOUT_TOKEN or rollout.vllm.token_file).",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="The teacher's dtype (null = model.dtype).")
    top_k: int = Field(
        0,
        ge=0,
        le=1024,
        description="0: the teacher scores the sampled tokens only, and weight x (teacher log-prob - student "
        "log-prob) is an advantage on each. k > 0: the teacher also names its k likeliest tokens at every "
        "completion position, and the loss gains weight x the forward KL from their renormalized probabilities to "
        "the student's (a token mean): the student learns the teacher's distribution at each position, not one "
        "sample of it (docs/algorithms.md, 'On-policy distillation'). At most 20 on a server (vLLM's max_logprobs).",
    )


class FsdpConfig(Section):
    reshard_after_forward: bool = Field(
        True,
        description="Free each layer's gathered weights after its forward (ZeRO-3-like, least memory); false "
        "keeps them until backward (ZeRO-2-like, less communication).",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep sharded parameters, gradients and optimizer state in CPU memory (GPU only; slower, "
        "fits bigger models).",
    )


class DeepSpeedConfig(Section):
    zero_stage: Literal[2, 3] = Field(
        3, description="ZeRO stage: 2 shards gradients + optimizer state, 3 also the parameters."
    )
    offload_optimizer: bool = Field(
        False, description="ZeRO-Offload: optimizer state and step in CPU memory (GPU only)."
    )
    offload_params: bool = Field(False, description="ZeRO-Infinity: parameters in CPU memory (stage 3, GPU only).")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged into the DeepSpeed JSON plait writes "
        "(e.g. {zero_optimization: {overlap_comm: true}}).",
    )


AUTO_PRECISION_ENV = "PLAIT_AUTO_PRECISION"  # fp32 or bf16: what `auto` means on this machine, detection aside


def fast_precision(device: str = "auto", deterministic: bool = False) -> tuple[str, str]:
    """What train.precision=auto means, and why: bf16 on a CUDA GPU that supports it and on a
    CPU that multiplies bf16 in hardware (AVX512_BF16 or AMX, kernels not capped to AVX2), else
    fp32. The demo in bf16 on such a CPU (an Intel Xeon with AMX) ended at least as high as in fp32
    over 5 seeds in 0.80x the time (docs/vs-trl.md, "auto"); without those units bf16 is several
    times slower. The
    deterministic mode stays at fp32 (it caps the kernels to AVX2, and bf16 rounding on a CPU is
    not pinned). PLAIT_AUTO_PRECISION=fp32|bf16 overrides the detection (the test suite pins fp32)."""
    import os

    import torch

    from plait.models import native_bf16_cpu

    pinned = os.environ.get(AUTO_PRECISION_ENV, "").strip().lower()
    if pinned in ("fp32", "bf16"):
        return pinned, f"{AUTO_PRECISION_ENV}={pinned}"
    if deterministic:
        return "fp32", "train.deterministic"
    if device != "cpu" and torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return "bf16", "a CUDA GPU with bf16"
        return "fp32", "a CUDA GPU without bf16"
    if native_bf16_cpu():
        return "bf16", "this CPU multiplies bf16 in hardware (AVX512_BF16/AMX)"
    return "fp32", "this CPU has no bf16 units (or its kernels are capped to AVX2)"


class TrainConfig(Section):
    max_steps: int = Field(
        20,
        ge=1,
        description="Rounds to run; each round generates, scores, then makes "
        "algo.num_iterations x algo.steps_per_generation optimizer updates.",
    )
    learning_rate: float = Field(3e-5, gt=0.0, description="Peak AdamW learning rate.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "cosine",
        description="LR schedule after warmup: the peak, then linear or cosine decay over the last train.decay_ratio "
        "of the updates (constant: none). The demo's held-out accuracy peaked at round 15 of 20 at a constant "
        "rate and fell by the end at every seed (docs/reproducibility.md, 'Runs that hold their peak').",
    )
    warmup_steps: int = Field(
        2,
        ge=0,
        description="Linear LR warmup, in applied optimizer updates (not rounds). Left unset, it is 2, or all the "
        "run's updates when it has fewer (a one-round smoke test); set, it must fit the run.",
    )
    lr_by_signal: bool = Field(
        True,
        description="Multiply each update's learning rate by the share of its completions that carry a gradient "
        "(a non-zero advantage): an update from 2 of 8 groups moves the policy a quarter as far as one from all 8. "
        "AdamW and gradient clipping otherwise take steps of one size whatever the share, and a step made from a "
        "few groups moves the policy as far as one from many (docs/reproducibility.md, 'Runs that hold their "
        "peak'); false = the learning rate as TRL means it.",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Linear and cosine decay end at this share of the peak LR (0 = decay to 0)."
    )
    decay_ratio: float = Field(
        0.4,
        gt=0.0,
        le=1.0,
        description="Linear and cosine decay run over this share of the updates after warmup, the last ones; the "
        "rate stays at its peak before them (warmup-stable-decay). 1 = every update after warmup (transformers' "
        "schedules).",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    shared_prompt_pass: bool = Field(
        True,
        description="Run each group's prompt through the model once for all its completions, forward and "
        "backward: each group packed into one row (prompt, then its completions, no padding), or a micro-batch's "
        "groups into one row holding their prompts' shared beginning once where that costs less, under every backend "
        "(DDP, FSDP2, ZeRO through their own forward); models with scaled logits get a KV cache handed on instead "
        "on backend local, padded rows elsewhere. Off with gradient checkpointing.",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Leave completions whose advantage is zero on every token (all-equal groups) out of the "
        "forward and backward when they can't change the update: no KL in the loss (beta 0), no entropy bonus, no "
        "entropy filter, and a loss aggregation whose normalizer does not depend on which rows share a "
        "micro-batch (not bnpo). The loss keeps the whole round's normalizer; update/skipped_rows logs the share.",
    )
    retain_host_memory: bool = Field(
        True,
        description="Keep freed host memory in the process for reuse (glibc: big blocks from the heap, no "
        "trimming) so the same big tensors are not page-faulted in again every micro-batch (faster on CPU); RSS "
        "then stays at its peak during the run.",
    )
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0, description="AdamW beta2.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the gradient norm (null = no clipping).")
    micro_batch_size: int = Field(16, ge=1, description="Completions per forward/backward on each process.")
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer update; null = derived from the batch arithmetic."
    )
    auto_batch: bool = Field(
        False, description="If the batch arithmetic does not fit, pick the nearest values that do (and say so)."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",  # the validator below replaces it with fp32 or bf16
        description="Autocast precision for forward passes (and generation). auto = bf16 on a CUDA GPU with bf16 "
        "and on a CPU that multiplies bf16 in hardware (AVX512_BF16 or AMX), else fp32; fp32 in the deterministic "
        "mode (decided where the config is loaded, said in the run header; PLAIT_AUTO_PRECISION=fp32|bf16 "
        "overrides the detection). Without bf16 units bf16 is several times slower than fp32.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where to train; auto = cuda when available, else cpu."
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (null = torch's default).")
    deterministic: bool = Field(
        False,
        description="Pin what can make two runs of one config differ: the kernels' instruction set (AVX2 code "
        "paths of ATen, oneDNN and MKL on x86, set before torch loads), thread counts (written into the "
        "resolved config), torch's deterministic algorithms; and add the round's first gradient and its final "
        "weights to the hashes in hashes.jsonl (every run hashes its tokens, rewards and advantages there), so "
        "`plait diff` names the stage where two runs part. The run header says what it could not pin.",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=0,
        description="Optimizer updates with a NaN/inf gradient are skipped (weights, optimizer and LR schedule "
        "untouched); after more than this many in a row the run stops (exit code 3) without writing a checkpoint.",
    )
    backend: Literal["auto", "local", "ddp", "fsdp2", "deepspeed"] = Field(
        "auto",
        description="How training processes share the work: local (one process), ddp (replicated weights), fsdp2 "
        "(sharded weights/grads/optimizer), deepspeed (ZeRO 2/3); auto = local for one process, ddp for more.",
    )
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig, description="Options of backend fsdp2.")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="Options of backend deepspeed.")

    @model_validator(mode="wrap")
    @classmethod
    def _auto_precision(cls, data, handler):
        auto = isinstance(data, dict) and data.get("precision", "auto") == "auto"
        if auto:
            data = {**data, "precision": fast_precision(data.get("device", "auto"), bool(data.get("deterministic")))[0]}
        model = handler(data)
        if auto:  # left unset, so the run header can tell what auto chose from what the config named
            model.__pydantic_fields_set__.discard("precision")
        return model

    @property
    def precision_auto(self) -> str | None:
        """Why `auto` chose train.precision; None when the config named it."""
        if "precision" in self.model_fields_set:
            return None
        return fast_precision(self.device, self.deterministic)[1]


class CheckpointConfig(Section):
    save_steps: int = Field(0, ge=0, description="Save a resumable checkpoint every N rounds (0 = only at the end).")
    save_every_minutes: float = Field(
        0.0,
        ge=0,
        description="Also save when this many minutes passed since the last save (0 = off); rank 0's clock decides.",
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints to keep; older ones are deleted after a new one commits.")
    async_save: bool = Field(
        True,
        description="Copy the state to CPU memory and write it in the background while training goes on "
        "(local, ddp, fsdp2; deepspeed saves synchronously). The end of the run waits for it.",
    )
    save_final_model: bool = Field(True, description="Write the trained model as a HF folder to OUTPUT_DIR/final.")
    keep_best: bool = Field(
        False,
        description="Also keep the model of the best evaluation so far (eval.metric; evaluations before, every "
        "eval.every_steps and after) as a HF folder in OUTPUT_DIR/best, with best.json saying which step.",
    )


class EvalConfig(Section):
    before: bool = Field(True, description="Evaluate (greedy) before training.")
    after: bool = Field(True, description="Evaluate (greedy) after training.")
    every_steps: int = Field(0, ge=0, description="Also evaluate every N rounds (0 = never).")
    metric: str = Field("boxed_accuracy", description="Reward function used as the accuracy metric.")
    max_completion_length: int | None = Field(None, ge=1, description="Null = rollout.max_completion_length.")
    batch_size: int = Field(100, ge=1, description="Prompts per greedy generate call.")


class RecoveryConfig(Section):
    enabled: bool = Field(
        False,
        description="When the watched score falls more than `margin` below its best, roll the run back to the state "
        "of its best (policy, optimizer, LR schedule, reference), multiply the learning rate by `lr_factor`, and go "
        "on with the prompts after the current ones; the round count goes on (no extra rounds). At most "
        "`max_recoveries` times: the next fall ends the run on its best state. docs/reproducibility.md.",
    )
    watch: Literal["auto", "eval", "reward"] = Field(
        "auto",
        description="eval: eval.metric at each evaluation (eval.before and every eval.every_steps); reward: the "
        "rounds' mean total reward averaged over `window` rounds; auto: eval when eval.every_steps > 0, else reward.",
    )
    margin: float = Field(
        0.1,
        gt=0.0,
        description="How far below its best the watched score may fall, in its own units (accuracy "
        "for eval, reward for reward), before the run rolls back.",
    )
    relative_margin: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Also a fall of more than this share of the best (0.1: below 0.9 x best) rolls back, "
        "whichever of it and `margin` is nearer the best. Meant for accuracies (watch=eval), where a "
        "best of 0.3 makes an absolute margin of 0.1 a third of it; null = `margin` alone.",
    )
    lr_factor: float = Field(0.5, gt=0.0, le=1.0, description="Each rollback multiplies the learning rate by this.")
    max_recoveries: int = Field(2, ge=0, description="Rollbacks at most; a fall after them ends the run on its best.")
    window: int = Field(3, ge=1, description="watch=reward: rounds whose mean reward is averaged into the score.")


class WandbConfig(Section):
    project: str = Field("plait", description="W&B project.")
    entity: str | None = Field(None, description="W&B team or user (null = your default).")
    name: str | None = Field(None, description="Run name (null = the run directory's name).")
    mode: Literal["online", "offline"] = Field(
        "offline",
        description="offline writes RUN_DIR/wandb with no network (`wandb sync` uploads it later); "
        "online streams to the server.",
    )
    tags: list[str] = Field(default_factory=list, description="Tags on the W&B run.")


class LogConfig(Section):
    console: Literal["rich", "plain", "none"] = Field("rich", description="Console output style.")
    every_steps: int = Field(1, ge=1, description="Print a metrics line every N rounds.")
    sample_every_steps: int = Field(10, ge=0, description="Log sample completions every N rounds (0 = never).")
    samples: int = Field(
        4, ge=1, description="Groups whose first completion is logged each time (prompt, completion, each reward)."
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."
    )
    wandb: WandbConfig | None = Field(
        None, description="Log to Weights & Biases (needs `pip install plait[wandb]`); null = off."
    )
    peak_flops: float | None = Field(
        None,
        gt=0,
        description="Peak FLOP/s of one training device for MFU (null = datasheet on known GPUs, a "
        "measured matmul peak on CPU).",
    )


class RayConfig(Section):
    address: str = Field(
        "auto",
        description="Ray cluster to run on: 'auto' = the one this machine joined (`ray start`, or RAY_ADDRESS as "
        "`ray job submit` sets it), 'local' = start a private one-node Ray here, or HOST:PORT / ray://HOST:PORT.",
    )
    device_resource: str = Field(
        "auto",
        description="Ray resource one device is: GPU, CPU, or a custom resource; auto = GPU when the "
        "cluster has GPUs, else CPU.",
    )
    cpus_per_process: float = Field(
        1.0, gt=0, description="CPUs each trainer / generation replica reserves (on CPU, its torch threads)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for every actor (PLAIT_*, HF_HUB_OFFLINE and "
        "TRANSFORMERS_VERBOSITY are passed on anyway).",
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long to wait for the cluster to grant the placement and for generation servers to come up.",
    )


class ClusterConfig(Section):
    launcher: Literal["torchrun", "ray"] = Field(
        "torchrun",
        description="torchrun: this process, or the processes torchrun started, are the job; ray: `plait train` "
        "places trainers and generation servers as actors on a Ray cluster (same as --ray).",
    )
    devices: int | None = Field(
        None,
        ge=1,
        description="Devices (GPUs, or processes on CPU) in the job, training + generation; null = the launcher's "
        "world size plus generation_devices (Ray: every device in the cluster).",
    )
    generation_devices: int = Field(
        0,
        ge=0,
        description="Devices reserved for generation servers (not training); under Ray plait starts the "
        "servers on them.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Ray: when a process dies, restart the job this many times, resuming from the last checkpoint.",
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Options of launcher ray.")


class _Environment(Section):
    """What every `environments:` entry has; each `type` is a model of its own (below), so an entry
    holds only the options its type reads."""

    ACTS_ON_ROWS: ClassVar[bool] = False  # acts on the data's rows (through tools), not problems of its own
    ELSEWHERE: ClassVar[str] = ""  # why an option of another type is not one of this type's

    type: str = Field(description="The kind of environment (each kind's model names its own).")
    name: str | None = Field(
        None,
        description="Label in metrics and eval, and the value of a row's `environment` column that selects this "
        "entry (null = the dataset's name, or the factory's).",
    )
    max_error_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the run when the environment fails (raises) on more than this share of a round's "
        "completions of it; fewer failures are left out of training and counted (env/<label>/errors).",
    )

    @property
    def label(self) -> str:
        return self.name or self._own_label() or self.type

    def _own_label(self) -> str | None:
        factory = getattr(self, "factory", None)
        return factory.rpartition(":")[2] if factory else None


class ReasoningGymEnvironment(_Environment):
    type: Literal["reasoning_gym"] = Field(
        description="reasoning_gym: a reasoning-gym dataset, scored by its own score_answer (docs/environments.md)."
    )
    dataset: str | None = Field(None, description="The dataset, e.g. basic_arithmetic, leg_counting.")
    config: dict[str, Any] = Field(default_factory=dict, description="The dataset's own options (its config class).")
    size: int = Field(1000, ge=1, description="Training problems generated (indices 0..size-1 of the seeded dataset).")
    eval_size: int = Field(50, ge=1, description="Held-out problems (another seed; any also in training are left out).")
    seed: int | None = Field(None, description="The dataset's seed (null = the run's seed).")
    weight: float | None = Field(
        None,
        gt=0,
        description="Share of the training prompts (null = in proportion to size; with weights the sizes' sum "
        "is split by them, an unweighted entry weighing 1).",
    )
    answer_format: Literal["answer_tag", "boxed"] = Field(
        "answer_tag",
        description="Where the completion states its answer: <answer>...</answer> (reasoning-gym's system prompt) "
        "or \\boxed{...}.",
    )
    examples: int | list[Example] = Field(
        0,
        description="Worked examples shown before each of this environment's prompts as earlier turns of the chat. "
        "A number (at most 8): problems of the same dataset drawn with a third seed (none a training or held-out "
        "problem), each answered with its bare reference answer in the answer format. A list [{prompt, "
        "completion}]: your own, the question worded as the dataset words it (plait adds the answer format's "
        "instruction, as to every prompt) and the answer written as the model should answer, working shown (e.g. "
        "`12 + 7 = \\boxed{19}`). Small models learn the answer's form, and from shown working the way to it, at "
        "once (docs/environments.md); 0 = none.",
    )

    def _own_label(self) -> str | None:
        return self.dataset

    @model_validator(mode="after")
    def _its_dataset_and_examples(self):
        if self.dataset is None:
            raise ValueError("an environment of type reasoning_gym needs `dataset` (e.g. basic_arithmetic)")
        if isinstance(self.examples, int) and not 0 <= self.examples <= 8:
            raise ValueError(f"examples: {self.examples} worked examples asked; give 0 to 8, or a list of your own")
        if isinstance(self.examples, list) and any(e.tool_output is not None for e in self.examples):
            raise ValueError("a reasoning_gym environment's worked examples answer without tools: drop tool_output")
        return self


class TrlEnvironment(_Environment):
    ACTS_ON_ROWS: ClassVar[bool] = True
    ELSEWHERE: ClassVar[str] = (
        " (a trl_env environment takes its rows from `data`, a row's `environment` column picking the entry: give "
        "worked examples there, data.examples)"
    )

    type: Literal["trl_env"] = Field(
        description="trl_env: a class in TRL's environment_factory form (reset, tool methods, get_reward) over the "
        "data's rows (docs/environments.md)."
    )
    factory: str | None = Field(
        None,
        description="'module:Name' (or 'path/to/file.py:Name'): a class, or a function of no arguments that "
        "returns one environment (one is made per rollout).",
    )
    trusted: bool = Field(
        False,
        description="true = the environment's methods run in the trainer's process, one live instance per "
        "rollout (as TRL runs them); false = in the sandbox, by replaying the rollout's calls (the environment "
        "must then be deterministic and import only the standard library).",
    )

    @model_validator(mode="after")
    def _its_factory(self):
        if self.factory is None:
            raise ValueError("an environment of type trl_env needs `factory: module:Name`")
        return self


class OpenEnvEnvironment(_Environment):
    ACTS_ON_ROWS: ClassVar[bool] = True
    ELSEWHERE: ClassVar[str] = (
        " (an openenv environment takes its rows from `data` and runs in this process or on its own server, not in "
        "plait's sandbox: run its server in a container of your own to contain it)"
    )

    type: Literal["openenv"] = Field(
        description="openenv: an OpenEnv environment (reset/step with a typed action), in this process or on its "
        "server, over the data's rows (docs/environments.md)."
    )
    factory: str | None = Field(
        None,
        description="'module:Name': an OpenEnv Environment class (or a function that makes one), run in this process.",
    )
    url: str | None = Field(
        None,
        description="The base URL of an OpenEnv server you started (e.g. http://127.0.0.1:8000); each rollout is a "
        "session on its /ws.",
    )
    connect_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a rollout waits for its session (a server at capacity is asked again until then); "
        "past it the rollout is an infrastructure error.",
    )

    @model_validator(mode="after")
    def _its_factory_or_server(self):
        if (self.factory is None) == (self.url is None):
            raise ValueError(
                "an environment of type openenv needs one of `factory: module:Name` (its Environment class, run in "
                "this process) or `url: http://HOST:PORT` (its server)"
            )
        return self


def _a_type_plait_can_install(value: Any) -> Any:
    if isinstance(value, dict) and "type" not in value:
        raise ValueError(f"an environment needs `type`: one of {', '.join(ENVIRONMENT_TYPES)}")
    if isinstance(value, dict) and value.get("type") == "verifiers":
        raise ValueError(
            "verifiers environments are not supported: no verifiers release installs beside plait's "
            "dependencies (0.4 pins mcp==2.0.0, 0.3 needs mcp<2 where vLLM needs mcp>=2, 0.1 needs datasets<4.7; "
            "docs/environments.md). Its harness can still drive the model from a Python environment of its "
            "own: start it from a rollout.agent function, pointed at the task's OpenAI-compatible base_url"
        )
    return value


# one model per `type` (a new kind of environment is one more model here and its entry in
# plait/programs/environments.py's KINDS)
ENVIRONMENT_MODELS = (ReasoningGymEnvironment, TrlEnvironment, OpenEnvEnvironment)


def type_tag(model: type[BaseModel]) -> str:
    """The `type` an entry model of a union stands for (its Literal)."""
    return model.model_fields["type"].annotation.__args__[0]


ENVIRONMENT_TYPES = tuple(map(type_tag, ENVIRONMENT_MODELS))
EnvironmentSpec = Annotated[
    ReasoningGymEnvironment | TrlEnvironment | OpenEnvEnvironment,
    Field(discriminator="type"),
    BeforeValidator(_a_type_plait_can_install),
]


class Config(Section):
    name: str | None = Field(
        None, description="Run name (null = from the data and the model, e.g. arithmetic-smollm2-135m-instruct)."
    )
    output_dir: str | None = Field(None, description="Run directory; null = runs/NAME-TIMESTAMP.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    resume: str = Field(
        "never",
        description="'never', 'auto' (continue from the newest complete checkpoint if any), or a checkpoint path.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=default_rewards,
        description="Reward functions [{name, weight, kwargs}], summed with their weights.",
    )
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    recovery: RecoveryConfig = Field(
        default_factory=RecoveryConfig, description="Roll a falling run back to its best state (off by default)."
    )
    log: LogConfig = Field(default_factory=LogConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    teacher: TeacherConfig | None = Field(
        None,
        description="A teacher model for on-policy distillation (null = none): its per-token log-probs of the "
        "student's samples become an advantage, alone (rollout.num_generations may be 1, rewards empty) or beside "
        "the rewards.",
    )
    environments: list[EnvironmentSpec] = Field(
        default_factory=list,
        description="Environments (docs/environments.md): reasoning_gym entries are a mixture of problems that "
        "replace the built-in task; trl_env entries act on the data's rows through tools. The reward defaults to "
        "`environment` (the verifier, or the environment's get_reward) and eval.metric too.",
    )

    @model_validator(mode="before")
    @classmethod
    def _environments_bring_their_prompts_and_verifier(cls, data: Any) -> Any:
        """With environments, the built-in task is off and each environment's own verifier is
        the reward and the eval metric, unless the config says otherwise."""
        if not isinstance(data, dict) or not data.get("environments"):
            return data
        data = dict(data)
        # a section already built (an assignment re-validates the whole config) had these applied
        built = {k for k in ("data", "rollout", "eval") if isinstance(data.get(k), BaseModel)}
        section = {} if "data" in built else dict(data.get("data") or {})
        kinds = {e.get("type") if isinstance(e, dict) else getattr(e, "type", None) for e in data["environments"]}
        if kinds <= {"trl_env", "openenv"}:  # they act on the data's rows through tools: hermes calls unless said
            rollout = dict(data.get("rollout") or {})
            if "rollout" not in built and rollout.get("tools") is None:
                data["rollout"] = {**rollout, "tools": {"format": "hermes", "python": False}}
        elif "data" not in built and "task" not in section and section.get("path") is None:
            data["data"] = {**section, "task": None}
        data.setdefault("rewards", [{"name": "environment"}])
        if "eval" not in built:
            data["eval"] = {"metric": "environment", **(data.get("eval") or {})}
        return data

    @property
    def optimizer_updates(self) -> int:
        """The run's optimizer updates: rounds x algo.num_iterations x algo.steps_per_generation."""
        return self.train.max_steps * self.algo.num_iterations * self.algo.steps_per_generation

    @model_validator(mode="after")
    def _default_warmup_fits_the_run(self) -> Config:
        """The default warmup shrinks to a run with fewer updates; one the config sets is kept,
        and `plait check` refuses it when the run is shorter (check_warmup)."""
        if "warmup_steps" not in self.train.model_fields_set and self.train.warmup_steps > self.optimizer_updates:
            self.train.warmup_steps = self.optimizer_updates
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
