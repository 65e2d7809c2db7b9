"""Everything a run builds before its first round, held in one `Run`.

open_run: run directory and metric sinks -> rewards (+ sandbox) -> tokenizer and prompts ->
model, reference and optimizer (the backend) -> generation engine -> resume from a checkpoint.
"""

from __future__ import annotations

import os
import random
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from plait import comm
from plait.checkpoint import checkpoint_step, load_checkpoint, load_rollouts, resume_position, trim_logs
from plait.config import Config
from plait.data import PromptOrder, build_prompts, describe_examples, load_rows
from plait.models import load_tokenizer
from plait.plan import BatchPlan
from plait.programs import RolloutProgram
from plait.programs.environments import describe_shots
from plait.programs.tools import Tools, tool_role
from plait.rewards import uses_sandbox
from plait.rewards.runner import BoundReward, bind_metric, bind_rewards, close_rewards
from plait.rollout import RolloutEngine, ahead_of_trainer, generation_site, make_engine, make_generator
from plait.rollout.packed import int8_full_range
from plait.rollout.precision import coarser, rollout_precision
from plait.rollout.vllm_engine import lora_kwargs, vllm_lora_rank
from plait.rollout.weights import pushes_adapters
from plait.sandbox.box import Sandbox
from plait.telemetry import MetricsSink, PhaseTimer
from plait.telemetry.flops import cpu_peak, device_peak, model_cost
from plait.telemetry.memory import MemoryMeter
from plait.telemetry.meter import StepMeter
from plait.train.backends.base import Backend
from plait.train.determinism import deterministic_process
from plait.train.guard import NonFiniteGuard, precisions
from plait.train.metrics import describe_processes
from plait.train.recovery import RecoveryState, watched
from plait.train.rollouts import RolloutSource, SourceState, make_rollout_source
from plait.train.rundir import prepare_run_dir
from plait.train.teacher import Teacher, make_teacher
from plait.train.update import why_nothing_is_skipped
from plait.types import Prompt


@dataclass
class TrainResult:
    run_dir: Path
    eval_before: float | None = None
    eval_after: float | None = None
    history: list[dict] = field(default_factory=list)


@dataclass
class Run:
    """What setup builds, and every round reads. `start` is the last round already done
    (0 for a fresh run, the checkpoint's round when resuming)."""

    cfg: Config
    plan: BatchPlan
    backend: Backend
    sink: MetricsSink
    run_dir: Path
    tokenizer: Any
    rewards: list[BoundReward]
    metric: BoundReward  # eval.metric: accuracy of each round's completions, and the evaluations
    sandbox: Sandbox | None  # where model-written code runs (None: no reward executes code)
    prompts: list[Prompt]
    eval_prompts: list[Prompt]
    order: PromptOrder  # which prompts this process takes next
    engine: RolloutEngine | None = None  # generates (synchronous runs) and evaluates
    program: RolloutProgram | None = None  # what a rollout is (plait/programs), sampling through `engine`
    teacher: Teacher | None = None  # scores every sampled token for distillation (None: no teacher)
    rollouts: RolloutSource | None = None  # where each round's groups come from
    meter: StepMeter | None = None
    start: int = 0
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    guard: NonFiniteGuard | None = None
    result: TrainResult | None = None
    recovery: RecoveryState = field(default_factory=RecoveryState)  # recovery.enabled's decisions so far

    @property
    def say(self):
        return self.sink.print

    @property
    def prompts_per_round(self) -> int:
        """Prompts this process generates for in one round (every update of the round)."""
        return self.plan.prompts_per_process * self.cfg.algo.steps_per_generation

    def take_prompts(self, n: int) -> list[Prompt]:
        return [self.prompts[i] for i in self.order.take(n)]


@contextmanager
def open_run(cfg: Config, plan: BatchPlan, backend: Backend, console: str | None = None) -> Iterator[Run]:
    """The run, set up and (when a checkpoint is due) resumed; its sinks are flushed on exit."""
    main = comm.is_main()
    run_dir, resume_from = prepare_run_dir(cfg)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    sink = MetricsSink(
        None, cfg.train.max_steps, (console or cfg.log.console) if main else "none", every=cfg.log.every_steps
    )
    cfg = resolved_config(cfg, plan, backend, sink.print)
    if main:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        # the rounds after the restart point run (and log) again; before any checkpoint, all of them
        start = 0 if resume_from is None else checkpoint_step(resume_from)
        dropped = trim_logs(run_dir, start)
        if dropped:
            sink.print(f"{dropped} log line(s) after round {start} dropped: those rounds run again")
        sink.open(run_dir, cfg.log, cfg.model_dump(mode="json"), start)
    run = None
    pins = ExitStack()
    try:
        pinned = pins.enter_context(deterministic_process(cfg, backend.device.type)) if cfg.train.deterministic else []
        run = build_run(cfg, plan, backend, sink, run_dir, pinned)
        if resume_from is not None:
            resume(run, resume_from)
        yield run
    finally:
        if run is not None:
            close_rewards([*run.rewards, run.metric])
            if run.program is not None:  # a run that failed, too: its endpoint and engine must not outlive it
                run.program.close()
            if run.teacher is not None:
                run.teacher.close()
            if run.engine is not None:
                run.engine.close()
        sink.finish()
        pins.close()


def resolved_config(cfg: Config, plan: BatchPlan, backend: Backend, say) -> Config:
    """The config as this run uses it: values the batch plan or `auto` chose are written in,
    and said, so nothing changes silently."""
    for note in plan.notes:
        say(f"[yellow]{note}")
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.prompts_per_step = plan.prompts_per_step
    cfg.train.micro_batch_size = plan.micro_batch_size
    cfg.train.gradient_accumulation_steps = plan.gradient_accumulation_steps
    a, r = cfg.algo, cfg.rollout
    auto_rollouts = r.precision == "auto"
    r.precision = rollout_precision(cfg, backend.device)
    if cfg.train.precision_auto:
        said = f"rollouts {r.precision}" + (" (rollout.precision=auto)" if auto_rollouts else "")
        say(f"train.precision=auto -> {cfg.train.precision}: {cfg.train.precision_auto}; {said}")
    coarse_rollouts = coarser(r.precision, cfg.train.precision) != cfg.train.precision
    if a.engine_is_correction is None:
        a.engine_is_correction = r.max_staleness > 0 or coarse_rollouts
        if r.max_staleness:
            say(f"rollout.max_staleness={r.max_staleness}: stale samples are corrected by algo.engine_is_correction")
        elif coarse_rollouts:
            say(f"rollout.precision={r.precision}: its samples are corrected by algo.engine_is_correction")
    if generation_site(cfg) == "process" and backend.device.type == "cpu":
        cores = len(os.sched_getaffinity(0))
        if cfg.train.threads is None:  # the generation process and the trainer share the cores
            cfg.train.threads = max(1, cores - (r.generator_threads or cores // 2))
        if r.generator_threads is None:
            r.generator_threads = max(1, cores - cfg.train.threads)
        say(f"on CPU: trainer {cfg.train.threads} thread(s), generation process {r.generator_threads}")
        if r.max_staleness:
            say(
                "[yellow]async on one CPU splits its cores between generation and training, so each phase runs "
                "slower: on a 2-core Zen 5 k=1 made 0.94x the synchronous default's rounds/hour (docs/async.md). "
                "It gains where generation has a device of its own (rollout servers)"
            )
    if cfg.train.deterministic and cfg.train.threads is None:  # written down, so a rerun uses the same count
        cfg.train.threads = torch.get_num_threads()
    if r.precision == "int8" and not int8_full_range():
        say(
            "[yellow]rollout.precision=int8 on a CPU without VNNI quantizes activations to 7 bits: on an AVX2-only "
            "AMD EPYC (Zen 1) the demo's int8 log-probs sat 0.3-1.2 nats from the trainer's, 4 of 5 seeds did not "
            "learn and rounds took 1.5x longer than fp32's (docs/vs-trl.md). rollout.precision=fp32 is faster there"
        )
    if cfg.train.deterministic and r.precision == "int8":
        say(
            "[yellow]train.deterministic: int8 rollouts run fbgemm's kernels for this CPU (7-bit activations where it "
            "has no VNNI), which the kernel caps do not pin: another CPU kind samples other tokens"
        )
    if cfg.train.deterministic and r.packed_weights:  # oneDNN's packed kernels have no reproducible mode
        r.packed_weights = False
        say("train.deterministic: rollout.packed_weights=false (generation through MKL's reproducible matmul)")
    if cfg.train.backend == "auto":
        cfg.train.backend = backend.name
        n = plan.training_processes
        say(f"train.backend=auto -> {backend.name} ({n} training process{'es' if n > 1 else ''})")
    return cfg


def build_run(
    cfg: Config, plan: BatchPlan, backend: Backend, sink: MetricsSink, run_dir: Path, pinned: list[str] = ()
) -> Run:
    """Rewards, data, model, optimizer and engine, in the order that fails cheapest first.
    `pinned`: what train.deterministic pinned and could not, for the header."""
    say = sink.print
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.seed)
    say(
        f"[bold]plait[/] run dir {run_dir}  |  {plan.prompts_per_step} prompts x {plan.num_generations} generations "
        f"over {plan.training_processes} process(es) ({backend.name}, {precisions(cfg)[1]}), "
        f"micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps} accumulation"
    )
    for line in pinned:
        say(f"deterministic: {line}")
    sandbox = None
    if uses_sandbox(cfg):  # refuses (SandboxUnavailable) below sandbox.min_tier, before any model loads
        sandbox = Sandbox.from_config(cfg.sandbox)
        say(
            f"sandbox: model-written code runs under isolation tier '{sandbox.tier}' (minimum "
            f"'{cfg.sandbox.min_tier}'; `plait sandbox` shows why)"
        )
    rewards, metric = bind_rewards(cfg.rewards, sandbox), bind_metric(cfg.eval.metric, sandbox)
    why = why_nothing_is_skipped(cfg)
    say("zero-advantage completions: " + ("left out of the update" if why is None else f"trained ({why})"))
    if cfg.train.lr_by_signal:
        every = "; with the teacher's advantage every completion has one, so the full rate" if cfg.teacher else ""
        say(
            "learning rate: each update's times the share of its completions with a non-zero advantage "
            f"(train.lr_by_signal){every}"
        )
    if cfg.recovery.enabled:
        r = cfg.recovery
        what = {"eval": f"evaluation ({cfg.eval.metric})", "reward": f"mean reward over {r.window} rounds"}
        share = f" (or {r.relative_margin:g} of it, if nearer)" if r.relative_margin is not None else ""
        say(
            f"recovery: watching the {what[watched(cfg)]}; a fall of more than {r.margin:g}{share} below its best "
            f"rolls back to the best state (learning rate x{r.lr_factor:g}, at most {r.max_recoveries} times)"
        )
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    tools = Tools.from_config(cfg, tokenizer)  # its sandbox, too, refuses below min_tier now
    for line in (tools.describe() or "").splitlines():
        say(line)

    for line in [describe_examples(cfg.data), *describe_shots(cfg.environments)]:
        if line:
            say(line)

    def prompts_of(split: str):
        rows = load_rows(cfg.data, split, cfg.seed, cfg.environments)
        return build_prompts(
            rows,
            tokenizer,
            cfg.data,
            log=say,
            tools=tools.schemas,
            envs=tools.envs,
            tool_role=tool_role(cfg),
            split=split,
        )

    prompts = prompts_of("train")
    evaluating = cfg.eval.before or cfg.eval.after or cfg.eval.every_steps
    eval_prompts = prompts_of("eval") if evaluating else []
    warning = tools.check(prompts)  # the chat template must append turns
    if warning:
        say(f"[yellow]{warning}[/]")
    backend.load(cfg)  # model (+ reference) + optimizer, sharded as the backend does it
    describe_processes(backend, run_dir, say)
    order = PromptOrder(len(prompts), cfg.seed, cfg.data.shuffle, rank=comm.rank(), stride=comm.world_size())
    run = Run(cfg, plan, backend, sink, run_dir, tokenizer, rewards, metric, sandbox, prompts, eval_prompts, order)
    run.meter = make_meter(cfg, backend, say)
    if ahead_of_trainer(cfg):  # the producer generates; this process's own HF engine evaluates
        engine = make_engine(_in_process(cfg), backend.module, tokenizer, view=backend.for_generation)
    else:
        engine = make_engine(cfg, backend.module, tokenizer, view=backend.for_generation, device=backend.device)

    note = lora_push_note(cfg, backend.module, backend.device)
    if note:
        say(note)

    def generator():
        engine, close = make_generator(cfg, tokenizer, backend.device)
        program = tools.program()

        def close_both():
            program.close()
            close()

        return engine, program, close_both

    run.rollouts = make_rollout_source(run, generator)
    run.engine, run.program = engine, tools.program()
    run.teacher = make_teacher(cfg, backend)
    if run.teacher is not None:
        say(f"teacher: {run.teacher.describe()}; weight {cfg.teacher.weight} on its per-token advantage")
    run.guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
    run.result = TrainResult(run_dir)
    return run


def resume(run: Run, checkpoint: Path) -> None:
    """Weights, optimizer, schedule, RNG and data position from `checkpoint` (and the rounds an
    async run had generated ahead); the logs are cut back to it (the rounds after it run again
    and log again)."""
    state = load_checkpoint(checkpoint, run.backend)
    run.start = state["step"]
    run.order.consumed = resume_position(state, comm.rank(), comm.world_size(), run.say)
    # the process count matches the one that wrote the checkpoint (rundir.refuse_another_process_count)
    ahead = comm.broadcast_object(load_rollouts(checkpoint) if comm.is_main() else None)
    run.rollouts.load_state(SourceState(ahead, [int(c) for c in comm.all_gather_objects(run.order.consumed)]))
    run.result.eval_before = state.get("eval_before")
    run.recovery = RecoveryState.from_dict(state.get("recovery"))
    run.say(f"resumed from {checkpoint} (round {run.start})")
    if run.sink.progress is not None:
        run.sink.progress.update(run.sink.task, completed=run.start)


def trainer_state(run: Run, consumed: list[int] | None = None) -> dict:
    """What a checkpoint needs besides the backend's state: every process's data position
    (`consumed`: rank 0's list of them, when its producer takes every process's prompts)."""
    per_rank = [int(c) for c in (comm.all_gather_objects(run.order.consumed) if consumed is None else consumed)]
    return {
        "prompts_consumed": sum(per_rank),
        "prompts_consumed_per_rank": per_rank,
        "eval_before": run.result.eval_before,
        "recovery": run.recovery.to_dict(),
    }


def _in_process(cfg: Config) -> Config:
    """The config with the HF engine in the training process (async runs evaluate with it)."""
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.engine = "hf"
    cfg.rollout.generation_process = False
    return cfg


def lora_push_note(cfg: Config, model, device: torch.device) -> str | None:
    """What a LoRA run hands its generation engine each round, where that is not the trainer's
    own model (the in-process HF engine samples from it directly)."""
    site = generation_site(cfg)
    vllm = cfg.rollout.engine == "vllm"
    if cfg.model.lora is None or (site == "trainer" and not vllm):
        return None
    engine = {"server": "rollout servers get", "process": "the generation process gets"}.get(site, "vLLM gets")
    if cfg.rollout.lora_push == "merged":
        return f"LoRA: {engine} merged weights each round (rollout.lora_push=merged)"
    if not pushes_adapters(model):
        return f"LoRA: {engine} merged weights each round (weights beyond the adapter are trained)"
    if vllm and vllm_lora_rank(cfg.model.lora.r) is None:
        return f"LoRA: {engine} merged weights each round (r={cfg.model.lora.r} is above vLLM's largest LoRA rank)"
    size = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad)
    shown = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
    if site == "server":
        return (
            f"LoRA: rollout servers get the adapter alone each round ({shown}) where they run vLLM's LoRA (started "
            "with the run's model.lora on GPU, or with rollout.lora_push=adapter), merged weights otherwise "
            "(weight_sync/adapter says which)"
        )
    if vllm and not lora_kwargs(cfg, device):
        return (
            "LoRA: vLLM gets merged weights each round (vLLM's CPU LoRA ops sample several times slower; "
            "rollout.lora_push=adapter to load the adapter alone anyway)"
        )
    if vllm:
        return f"LoRA: vLLM loads the adapter alone each round ({shown}; vLLM's LoRA, not merged weights)"
    return f"LoRA: the generation process gets the adapter alone each round ({shown})"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_meter(cfg: Config, backend: Backend, say) -> StepMeter:
    """Throughput/MFU/memory per round: the model's FLOPs per token and one device's peak."""
    hf_config = getattr(backend.module, "config", None)
    described = backend.describe()
    if cfg.model.lora:
        trainable = sum(p.numel() for p in backend.module.parameters() if p.requires_grad)
    else:
        trainable = described["params_total"]
    cost = model_cost(hf_config, described["params_total"], trainable) if hf_config is not None else None
    peak, source = (None, "")
    if comm.is_main():  # one measurement (on CPU), while the others wait: they would compete for the cores
        peak, source = device_peak(backend.device, cfg.train.precision, cfg.log.peak_flops)
    peak, source = comm.broadcast_object((peak, source))
    say(f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({source})" if peak else f"no MFU: {source}")
    if comm.is_main() and backend.device.type == "cpu" and cfg.train.precision == "bf16" and not cfg.log.peak_flops:
        fp32 = cpu_peak("fp32")
        if peak and fp32 > peak:
            say(
                f"note: bf16 matmuls reach {peak / 1e9:.3g} GFLOP/s on this CPU and fp32 {fp32 / 1e9:.3g}: "
                f"train.precision=fp32 would run the matmuls about {fp32 / peak:.2g}x faster here"
            )
    local = generation_site(cfg) == "trainer"
    return StepMeter(cost, peak, MemoryMeter(backend.device), local)
