"""What a checkpoint costs the training loop: synchronous vs asynchronous saves.

    .venv/bin/python bench/checkpoint.py [--steps 4] [--model smollm2]

Trains the bundled SmolLM2-135M (or a tiny random model with --model tiny) for a few steps,
saving after every step, once with checkpoint.async_save=false and once with true, and prints
the median seconds the loop spent in the checkpoint phase per step (async: the copy to CPU
plus any wait for the previous save), the median step time, and the checkpoint's size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _runs import train_metrics


def run(out: Path, steps: int, model: str, async_save: bool) -> list[dict]:
    sets = [
        f"train.max_steps={steps}",
        "checkpoint.save_steps=1",
        f"checkpoint.async_save={str(async_save).lower()}",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=32",
        "train.micro_batch_size=8",
        "eval.before=false",
        "eval.after=false",
        "log.console=none",
        "checkpoint.save_final_model=false",
        f"output_dir={out}",
    ]
    if model != "smollm2":
        sets.append(f"model.name_or_path={model}")
    return train_metrics(sets, out, f"bench/checkpoint.py: run {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default="smollm2", help="smollm2 (the bundled model) or tiny")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from plait.models import tiny_model

            model = str(tiny_model(Path(tmp) / "tiny"))
        print("| saves | checkpoint phase, s/step (median) | step, s (median) | checkpoint size |")
        print("|---|---|---|---|")
        for async_save in (False, True):
            out = Path(tmp) / f"run-{async_save}"
            rows = run(out, args.steps, model, async_save)[:-1]  # the last step's save is the final, blocking one
            checkpoints = out / "checkpoints"
            total = sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file())
            size = total / len(list(checkpoints.iterdir()))
            print(
                f"| {'async' if async_save else 'sync'} | "
                f"{statistics.median(r['time/checkpoint'] for r in rows):.2f} | "
                f"{statistics.median(r['time/step'] for r in rows):.2f} | {size / 2**20:.0f} MiB |"
            )


if __name__ == "__main__":
    main()
