"""plait vs TRL's GRPOTrainer on the same work, side by side.

    .venv/bin/pip install -e '.[bench]'          # TRL (it brings no new torch)
    .venv/bin/python bench/vs_trl.py --size small [--steps 8] [--rounds 2]
    .venv/bin/python bench/vs_trl.py --size large --steps 3 --rounds 1
    .venv/bin/python bench/vs_trl.py --only plait --plait-set rollout.packed_weights=false  # plait's A/B

Both trainers get the same model (the bundled SmolLM2-135M-Instruct, fp32 weights), the same
prompts (the arithmetic task, chat template applied once by plait and handed to TRL as the
same text), the same reward functions and weights (plait's accuracy 1.0 + boxed_format 0.5),
num_generations, completion length (no early stop: both sample up to max_completion_length or
EOS), batch (prompts x generations per optimizer step, one optimizer step per generation),
learning rate (constant, no warm-up, every update's: plait's `train.lr_by_signal` is off here),
loss (DAPO token-level, beta 0, group-scaled advantages), prompt order (TRL is handed the rows in
the order plait's seeded draw takes them, with its own shuffling off: step k of both trains on
the same prompts, checked from what each side's reward functions were given), precision
(training and sampling: with --precision bf16 plait's rollouts sample in bf16, as TRL's
generation does) and seed. TRL's gradient checkpointing (its default) is off, as
plait's is, so both do the same arithmetic (--trl-gradient-checkpointing to compare with it on).

Each run is its own process (clean peak RSS). The rounds alternate plait, TRL, plait, TRL ...
(round r at seed --seed + r); each run's first --warmup steps are left out of the timings.
Printed: the median step time, completion tokens/s and peak RSS of each, the ratio plait/TRL, and whether their mean
reward per step differs (a permutation test over the steps of all rounds), per seed and over all:
with the same prompts each step, what differs between the two is the trainers' sampling and
updates, not which problems they drew.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


SIZES = {  # prompts per step, generations per prompt, completion tokens, micro-batch
    "small": (2, 4, 32, 8),
    "large": (8, 8, 128, 16),
}
LR = 3e-5
PHASES = ("time/generate", "time/score", "time/logprobs", "time/train", "time/optimizer")  # plait's telemetry
REWARD_WEIGHTS = (1.0, 0.5)


def shared_prompts(model: str, seed: int):
    """The arithmetic task's training rows, as plait builds them (chat template applied)."""
    from plait.config import load_config
    from plait.data import build_prompts, load_rows
    from plait.models import load_tokenizer

    cfg = load_config(None, [f"model.name_or_path={model}", f"seed={seed}"])
    tok = load_tokenizer(cfg.model.name_or_path)
    return cfg, tok, build_prompts(load_rows(cfg.data, "train", seed), tok, cfg.data)


def plait_draw(n_rows: int, per_step: int, steps: int, seed: int) -> list[int]:
    """The rows plait's run takes, in order: its seeded permutation per epoch, read sequentially."""
    from plait.data import PromptOrder

    return PromptOrder(n_rows, seed).take(per_step * steps)


def prompts_per_step(seen: list[str], per_step: int) -> list[list[str]]:
    """A run's prompt texts, step by step."""
    return [seen[i : i + per_step] for i in range(0, len(seen), per_step)]


# ---------------------------------------------------------------- one run, in its own process


def run_plait(
    model: str,
    size: str,
    steps: int,
    seed: int,
    out: Path,
    device: str = "cpu",
    precision: str = "fp32",
    overrides: tuple[str, ...] = (),
) -> dict:
    from plait.config import load_config
    from plait.train.loop import train

    prompts, gens, length, micro = SIZES[size]
    cfg = load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"seed={seed}",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.num_generations={gens}",
            f"rollout.max_completion_length={length}",
            f"train.micro_batch_size={micro}",
            f"train.max_steps={steps}",
            f"train.learning_rate={LR}",
            "train.warmup_steps=0",
            "train.lr_scheduler=constant",
            f"train.precision={precision}",
            f"rollout.precision={precision}",  # TRL samples in its training precision too
            f"train.device={device}",
            "algo.loss_type=dapo",
            "algo.beta=0",
            "algo.scale_rewards=group",
            f"rewards=[{{name: accuracy, weight: {REWARD_WEIGHTS[0]}}}, "
            f"{{name: boxed_format, weight: {REWARD_WEIGHTS[1]}}}]",
            "eval.before=false",
            "eval.after=false",
            "train.lr_by_signal=false",  # TRL's rate is every update's
            "log.console=none",
            "log.tensorboard=false",
            "log.sample_every_steps=1",  # every group's prompt, to check the order against TRL's
            f"log.samples={prompts}",
            "checkpoint.save_steps=0",
            "checkpoint.save_final_model=false",
            f"output_dir={out / 'run'}",
            *overrides,
        ],
    )
    result = train(cfg)
    samples = [json.loads(line) for line in (out / "run" / "samples.jsonl").read_text().splitlines()]
    return {
        "prompts": [r["prompt"] for r in samples],
        "step_s": [m["time/step"] for m in result.history],
        "reward": [m["reward/total/mean"] for m in result.history],
        "completion_tokens": [m["tokens/generated"] for m in result.history],
        "phases": {k[5:]: [m.get(k, 0.0) for m in result.history] for k in PHASES},
    }


def run_trl(
    model_name: str,
    size: str,
    steps: int,
    seed: int,
    out: Path,
    gradient_checkpointing: bool,
    device: str = "cpu",
    precision: str = "fp32",
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from plait.models import resolve_model_path
    from plait.rewards.format import boxed_format
    from plait.rewards.math import accuracy

    n_prompts, gens, length, micro = SIZES[size]
    _, tok, prompts = shared_prompts(model_name, seed)
    drawn = [prompts[i] for i in plait_draw(len(prompts), n_prompts, steps, seed)]
    data = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in drawn])
    per_step = {"reward": [], "completion_tokens": [], "prompts": []}

    def accuracy_reward(completions, answer, completion_ids, prompts, **_):
        per_step["completion_tokens"].append(sum(len(c) for c in completion_ids))
        per_step["prompts"] += prompts[::gens]  # each prompt's group is gens rows in a row
        return accuracy(completions, answer)

    def format_reward(completions, **_):
        return boxed_format(completions)

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                per_step["reward"].append(logs["reward"])

    accumulation = max(1, n_prompts * gens // micro)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        seed=seed,
        data_seed=seed,
        shuffle_dataset=False,  # the rows are already in plait's draw order
        use_cpu=device == "cpu",
        bf16=precision == "bf16",
        fp16=False,
        num_generations=gens,
        max_completion_length=length,
        per_device_train_batch_size=min(micro, n_prompts * gens),
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=steps,
        loss_type="dapo",
        beta=0.0,
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        reward_weights=list(REWARD_WEIGHTS),
        gradient_checkpointing=gradient_checkpointing,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model_name)), dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy_reward, format_reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    trainer.train()
    return {
        "step_s": clock.times,
        "reward": per_step["reward"],
        "completion_tokens": per_step["completion_tokens"],
        "prompts": per_step["prompts"],
    }


def worker(args) -> None:
    out = Path(args.tmp)
    if args.worker == "plait":
        res = run_plait(
            args.model, args.size, args.steps + args.warmup, args.seed, out, args.device, args.precision, args.plait_set
        )
    else:
        res = run_trl(
            args.model,
            args.size,
            args.steps + args.warmup,
            args.seed,
            out,
            args.trl_gradient_checkpointing,
            args.device,
            args.precision,
        )
    res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.device == "cuda":
        import torch

        res["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
    Path(args.result).write_text(json.dumps(res))


# ---------------------------------------------------------------- the comparison


def permutation_p(a: list[float], b: list[float], rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of the difference of means of a and b (label shuffling)."""
    rng = random.Random(seed)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    pooled, hits = a + b, 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if abs(statistics.fmean(pooled[: len(a)]) - statistics.fmean(pooled[len(a) :])) >= observed - 1e-12:
            hits += 1
    return (hits + 1) / (rounds + 1)


def verdict(a: list[float], b: list[float]) -> dict:
    """Whether plait's rewards per step (a) and TRL's (b) differ, and which way."""
    p = permutation_p(a, b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    return {
        "reward_diff": diff,
        "reward_p": p,
        "learning": "indistinguishable" if p >= 0.05 else ("plait better" if diff > 0 else "TRL better"),
    }


def same_prompts(mine: list[str], theirs: list[str], per_step: int) -> bool:
    """Did both sides train on the same prompts at every step (in any order within a step)?"""
    a, b = prompts_per_step(mine, per_step), prompts_per_step(theirs, per_step)
    return len(a) == len(b) and all(sorted(x) == sorted(y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="plait, TRL pairs (alternating)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the bundled model, or a model folder")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off unless given")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both train and generate")
    ap.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32", help="both: fp32 weights, bf16 autocast when bf16"
    )
    ap.add_argument(
        "--plait-set", action="append", default=[], metavar="KEY=VALUE", help="a config override for plait's runs"
    )
    ap.add_argument("--only", choices=["plait", "trl"], help="run one side alone (no ratio, no reward test)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", choices=["plait", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    sides = (args.only,) if args.only else ("plait", "trl")
    runs: dict[str, list[dict]] = {who: [] for who in sides}
    for r in range(args.rounds):
        for who in sides:
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "result.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    who,
                    "--model",
                    args.model,
                    "--size",
                    args.size,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--seed",
                    str(args.seed + r),
                    "--tmp",
                    tmp,
                    "--result",
                    str(result),
                    "--device",
                    args.device,
                    "--precision",
                    args.precision,
                ]
                if args.trl_gradient_checkpointing:
                    cmd.append("--trl-gradient-checkpointing")
                for override in args.plait_set:
                    cmd += ["--plait-set", override]
                t0 = time.perf_counter()
                env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    sys.exit(f"{who} run failed:\n{proc.stderr[-4000:]}")
                runs[who].append(json.loads(result.read_text()))
                print(f"round {r + 1}: {who:<5} {time.perf_counter() - t0:6.0f} s wall", flush=True)

    prompts, gens, length, _ = SIZES[args.size]
    summary = {
        "size": args.size,
        "device": args.device,
        "precision": args.precision,
        "prompts": prompts,
        "generations": gens,
        "completion_tokens": length,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "plait_overrides": args.plait_set,
    }
    print(
        f"\n{args.size}: {prompts} prompts x {gens} generations x {length} tokens, "
        f"{args.steps} timed steps x {args.rounds} round(s) each, {args.precision}, {args.device}"
        + (f"; plait with {' '.join(args.plait_set)}" if args.plait_set else "")
    )
    print(f"{'':<8}{'step s (median)':>16}{'completion tok/s':>18}{'peak RSS GiB':>14}{'mean reward':>13}")
    for who, rs in runs.items():
        steps = [s for r in rs for s in r["step_s"][args.warmup :]]
        toks = [t for r in rs for t in r["completion_tokens"][args.warmup :]]
        rewards = [x for r in rs for x in r["reward"]]
        summary[who] = {
            "step_s_median": statistics.median(steps),
            "step_s": steps,
            "tokens_per_s": sum(toks) / sum(steps),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in rs),
            "reward_mean": statistics.fmean(rewards),
            "reward_per_step": [r["reward"] for r in rs],
            "prompts_per_step": [prompts_per_step(r["prompts"], prompts) for r in rs],  # per round
        }
        s = summary[who]
        print(
            f"{who:<8}{s['step_s_median']:>16.2f}{s['tokens_per_s']:>18.1f}"
            f"{s['peak_rss_gb']:>14.2f}{s['reward_mean']:>13.3f}"
        )
    if "plait" in runs:
        phases = {
            k: statistics.median(x for r in runs["plait"] for x in r["phases"][k][args.warmup :])
            for k in runs["plait"][0]["phases"]
        }
        summary["plait"]["phase_s_median"] = phases
        print("plait's step by phase (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    if args.only:
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        return
    ratio = summary["plait"]["step_s_median"] / summary["trl"]["step_s_median"]
    print(f"\nplait / TRL step time: {ratio:.2f}x ({1 / ratio:.2f}x faster; goal <= 0.40x)")
    summary["per_seed"] = []
    for r, (mine, theirs) in enumerate(zip(runs["plait"], runs["trl"])):
        same = same_prompts(mine["prompts"], theirs["prompts"], prompts)
        seed_ratio = statistics.median(mine["step_s"][args.warmup :]) / statistics.median(
            theirs["step_s"][args.warmup :]
        )
        row = {
            "seed": args.seed + r,
            "ratio": seed_ratio,
            "same_prompts": same,
            **verdict(mine["reward"], theirs["reward"]),
        }
        summary["per_seed"].append(row)
        print(
            f"seed {row['seed']}: step {seed_ratio:.2f}x; same prompts each step: {'yes' if same else 'NO'}; "
            f"reward plait - TRL = {row['reward_diff']:+.3f}, p = {row['reward_p']:.3f} -> {row['learning']}"
        )
    pooled = verdict([x for r in runs["plait"] for x in r["reward"]], [x for r in runs["trl"] for x in r["reward"]])
    summary.update(ratio=ratio, **pooled)
    print(
        f"mean reward per step, all seeds: plait - TRL = {pooled['reward_diff']:+.3f}, "
        f"permutation p = {pooled['reward_p']:.3f} -> {pooled['learning']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
