"""Batch arithmetic: how one step's completions split over processes and micro-batches.

One optimizer step trains on `prompts_per_step x num_generations` completions. Each training
process owns whole groups (so group statistics never need another process's rewards), i.e.
`prompts_per_step / processes` prompts, and splits its completions into micro-batches of
`micro_batch_size`, accumulating gradients over them. When the numbers don't divide, the
error shows the arithmetic with the user's numbers and the values that would work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchPlan:
    training_processes: int
    prompts_per_step: int
    num_generations: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    notes: tuple[str, ...] = field(default=())

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def prompts_per_process(self) -> int:
        return self.prompts_per_step // self.training_processes

    @property
    def completions_per_process(self) -> int:
        return self.prompts_per_process * self.num_generations


def fits(prompts: int, gens: int, micro: int, procs: int, accum: int | None = None) -> bool:
    """True when the step splits into whole groups per process and whole micro-batches."""
    if procs < 1 or prompts % procs:
        return False
    per_proc = prompts // procs * gens
    if per_proc % micro:
        return False
    return accum is None or per_proc // micro == accum


def launcher_world_size() -> int:
    """Processes started by torchrun/Ray for this job (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _near(values: list[int], target: int, k: int = 4) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:k])


def explain(prompts: int, gens: int, micro: int, procs: int, accum: int | None, devices: int, gen_devices: int) -> str:
    """The arithmetic with the user's numbers and, for each knob, the values that would fit."""
    total = prompts * gens
    who = f"{procs} training process{'es' if procs != 1 else ''}"
    if gen_devices:
        who += f" ({devices} devices - {gen_devices} for generation)"
    lines = [
        f"batch arithmetic: rollout.prompts_per_step={prompts} x rollout.num_generations={gens} = "
        f"{total} completions per step must split into whole groups over {who}, "
        f"then into micro-batches of train.micro_batch_size={micro}"
        + (f" x train.gradient_accumulation_steps={accum}" if accum else "")
        + "."
    ]
    if procs < 1:
        lines.append(f"No device is left for training: use cluster.generation_devices < {devices}.")
        return " ".join(lines)
    if prompts % procs:
        lines.append(f"{prompts} prompts / {procs} processes = {prompts / procs:.2f} is not whole.")
    else:
        per = prompts // procs * gens
        if per % micro:
            lines.append(f"Each process gets {per} completions, which is not a multiple of {micro}.")
        elif accum is not None:
            lines.append(f"Each process gets {per} completions = {per // micro} micro-batches of {micro}, not {accum}.")
    fix = []
    ok_prompts = [p for p in range(1, max(4 * prompts, 64) + 1) if fits(p, gens, micro, procs, accum)]
    if ok_prompts:
        fix.append(f"rollout.prompts_per_step in {_near(ok_prompts, prompts)}")
    ok_gens = [g for g in range(2, 65) if fits(prompts, g, micro, procs, accum)]
    if ok_gens:
        fix.append(f"rollout.num_generations in {_near(ok_gens, gens, 6)}")
    ok_micro = [m for m in range(1, prompts * gens + 1) if fits(prompts, gens, m, procs, accum)]
    if ok_micro:
        fix.append(f"train.micro_batch_size in {_near(ok_micro, micro, 6)}")
    if accum is not None and fits(prompts, gens, micro, procs):
        fix.append(f"train.gradient_accumulation_steps={prompts // procs * gens // micro} (or null to derive it)")
    if devices > 1 or gen_devices:
        ok_procs = [p for p in range(1, devices + 1) if fits(prompts, gens, micro, p, accum)]
        if ok_procs:
            fix.append("training processes in " + str(ok_procs) + " (cluster.generation_devices = devices - that)")
    plural = "es" if procs != 1 else ""
    lines.append(f"Values that work with {procs} training process{plural}: " + "; or ".join(fix) + ".")
    if not ok_gens and prompts % procs:
        lines.append(
            "No rollout.num_generations alone fixes it: "
            "processes split the batch by prompt, so every group stays on one process."
        )
    lines.append("Or set train.auto_batch=true to let plait pick the nearest fitting values.")
    return " ".join(lines)


def plan_batch(
    prompts: int,
    gens: int,
    micro: int,
    accum: int | None,
    devices: int,
    gen_devices: int = 0,
    auto: bool = False,
) -> BatchPlan | str:
    """A BatchPlan, or (when it doesn't fit and `auto` is off) the explanation string."""
    procs = devices - gen_devices
    if fits(prompts, gens, micro, procs, accum):
        per = prompts // procs * gens
        return BatchPlan(procs, prompts, gens, micro, per // micro)
    if not auto or procs < 1:
        return explain(prompts, gens, micro, procs, accum, devices, gen_devices)
    # auto: keep num_generations (it shapes the algorithm); raise prompts to the next multiple
    # of the process count, then take the largest micro-batch <= the requested one that fits.
    new_prompts = next(p for p in range(prompts, prompts + procs + 1) if p % procs == 0)
    per = new_prompts // procs * gens
    new_micro = max(m for m in range(1, min(micro, per) + 1) if per % m == 0)
    notes = []
    if new_prompts != prompts:
        notes.append(
            f"auto_batch: rollout.prompts_per_step {prompts} -> {new_prompts} (a multiple of {procs} processes)"
        )
    if new_micro != micro:
        notes.append(
            f"auto_batch: train.micro_batch_size {micro} -> {new_micro} (divides {per} completions per process)"
        )
    if accum is not None and accum != per // new_micro:
        notes.append(f"auto_batch: train.gradient_accumulation_steps {accum} -> {per // new_micro}")
    return BatchPlan(procs, new_prompts, gens, new_micro, per // new_micro, tuple(notes))
