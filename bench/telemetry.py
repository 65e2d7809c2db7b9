"""What plait's telemetry costs a training step.

    .venv/bin/python bench/telemetry.py [--steps 6] [--model smollm2|tiny] [--wandb]

Trains in this process with every telemetry call wrapped in a stopwatch: the per-step
metrics (FLOPs, MFU, memory, collectives: StepMeter), the sinks (metrics.jsonl, console line,
TensorBoard, W&B offline with --wandb, samples every step here) and the rollout statistics.
Prints the median seconds per step spent in them, the median step time and the share (goal:
< 1%), plus the one-time start-up costs (the CPU peak measurement, opening the sinks).
The tiny model's steps are short, so its share is the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from plait.config import load_config
from plait.rewards import runner
from plait.telemetry import flops, meter, sinks
from plait.train import loop, setup
from plait.train.loop import train


SPENT: dict[str, list[float]] = defaultdict(list)


def stopwatch(owner, name: str, label: str) -> None:
    """Replace owner.name with a wrapper that records its seconds under `label`."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[label].append(time.perf_counter() - t0)

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="smollm2", help="smollm2 (the bundled model) or tiny (a 2-layer random model)")
    ap.add_argument("--wandb", action="store_true", help="also log to W&B (offline)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = "smollm2-135m-instruct"
        if args.model == "tiny":
            from plait.models import tiny_model

            model = str(tiny_model(Path(tmp) / "tiny"))
        sets = [
            f"model.name_or_path={model}",
            f"train.max_steps={args.steps}",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=32",
            "train.micro_batch_size=8",
            "eval.before=false",
            "eval.after=false",
            "log.console=plain",
            "log.sample_every_steps=1",
            "checkpoint.save_final_model=false",
            "checkpoint.save_steps=0",
            f"output_dir={tmp}/run",
        ]
        if args.wandb:
            sets.append("log.wandb={mode: offline, project: plait-bench}")
        stopwatch(meter.StepMeter, "measure", "per-step figures (MFU, memory, collectives)")
        stopwatch(meter.StepMeter, "flops", "FLOPs count")
        stopwatch(sinks.MetricsSink, "log", "sinks: jsonl + console + TensorBoard" + (" + W&B" if args.wandb else ""))
        stopwatch(sinks.MetricsSink, "samples", "samples (every step here)")
        stopwatch(loop, "round_rollout_metrics", "rollout statistics")
        stopwatch(runner.RewardReport, "metrics", "reward timeouts/seconds")
        stopwatch(sinks.MetricsSink, "open", "start-up: open the sinks")
        stopwatch(setup, "make_meter", "start-up: cost model + device peak")
        flops._cache_file = lambda: Path(tmp) / "peak.json"  # measure the peak, as a first run does
        result = train(load_config(None, sets))

    steps = result.history[1:]  # the first step warms up
    step_s = statistics.median(m["time/step"] for m in steps)
    print(f"\n{args.model}: {len(result.history)} steps, median step {step_s:.3f} s (first step left out)\n")
    print(f"{'telemetry part':<52}{'median s/step':>14}{'share':>9}")
    total = 0.0
    for label, times in SPENT.items():
        if label.startswith("start-up"):
            continue
        per_step = statistics.median(times[1:] or times)
        total += per_step
        print(f"{label:<52}{per_step:>14.5f}{per_step / step_s:>9.2%}")
    print(f"{'all per-step telemetry':<52}{total:>14.5f}{total / step_s:>9.2%}   (goal < 1%)")
    for label, times in SPENT.items():
        if label.startswith("start-up"):
            print(f"{label:<52}{sum(times):>14.3f} s once")


if __name__ == "__main__":
    main()
