"""Step time and peak memory per process: local vs ddp vs fsdp2 vs deepspeed (ZeRO-2, ZeRO-3).

    .venv/bin/python bench/distributed.py [--model smollm2-135m-instruct] [--steps 4] [--nproc 2]

Each backend runs a real `plait train` (torchrun for the distributed ones) on the same small
GRPO step: 4 prompts x 4 generations of up to 32 tokens, micro-batches of 4, bf16 autocast.
Step time is the mean `time/step` over the steps after the first (which pays one-time
costs); `train` is the policy-update part of it. Peak memory is each process's peak RSS (CPU)
or peak CUDA allocation (GPU), from RUN_DIR/cluster.json. On a CPU with few cores the
processes share them, so distributed runs are *slower* there: the bench then shows what each
backend costs in memory and overhead, not a speed-up.

With --packing both, each backend runs twice, with each group packed into one row
(train.shared_prompt_pass=true, the default) and with padded rows (false); `train tok/s` is the
completion tokens trained per second of the policy update (tokens/s_train), and the last
column the packed run's gain over the padded one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plait.comm import free_port


BACKENDS = {
    "local": [],
    "ddp": ["train.backend=ddp"],
    "fsdp2": ["train.backend=fsdp2"],
    "deepspeed-zero2": ["train.backend=deepspeed", "train.deepspeed.zero_stage=2"],
    "deepspeed-zero3": ["train.backend=deepspeed", "train.deepspeed.zero_stage=3"],
}


def run(name: str, extra: list[str], args, root: Path) -> dict:
    out = root / name
    opts = [
        f"model.name_or_path={args.model}",
        f"train.max_steps={args.steps}",
        "rollout.prompts_per_step=4",
        "rollout.num_generations=4",
        "rollout.max_completion_length=32",
        "train.micro_batch_size=4",
        "train.precision=bf16",
        "eval.before=false",
        "eval.after=false",
        "checkpoint.save_final_model=false",
        "log.console=none",
        f"output_dir={out}",
        *extra,
    ]
    launcher = (
        []
        if name == "local"
        else ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port", str(free_port())]
    )
    cmd = [sys.executable, *launcher, "-m", "plait", "train", *sum((["--set", o] for o in opts), [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    procs = json.loads((out / "cluster.json").read_text())
    mem_key = "peak_cuda_mb" if "peak_cuda_mb" in procs[0] else "peak_rss_mb"
    return {
        "backend": name,
        "processes": len(procs),
        "step_s": statistics.fmean(m["time/step"] for m in steps),
        "train_s": statistics.fmean(m["time/train"] for m in steps),
        "train_tokens_per_s": statistics.fmean(m["tokens/s_train"] for m in steps),
        "generate_s": statistics.fmean(m["time/generate"] for m in steps),
        "params_per_process_M": procs[0]["params_local"] / 1e6,
        "peak_mb_per_process": max(p[mem_key] for p in procs),
        "memory": mem_key,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    ap.add_argument("--only", nargs="*", default=list(BACKENDS))
    ap.add_argument(
        "--packing", choices=["on", "off", "both"], default="on", help="groups packed into one row (shared_prompt_pass)"
    )
    args = ap.parse_args()
    packings = {"on": [True], "off": [False], "both": [True, False]}[args.packing]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            for packed in packings:
                extra = [*BACKENDS[name], f"train.shared_prompt_pass={str(packed).lower()}"]
                row = run(f"{name}-{'packed' if packed else 'padded'}", extra, args, Path(tmp))
                rows.append({**row, "backend": name, "packed": packed})
                print(json.dumps(rows[-1]), flush=True)
    labels = {"peak_rss_mb": "peak RSS per process (MB)", "peak_cuda_mb": "peak CUDA memory per process (MB)"}
    label = labels[rows[0]["memory"]]
    padded = {r["backend"]: r for r in rows if not r["packed"]}
    head = ["backend", "rows", "processes", "step s", "train s", "train tok/s", "generate s", "params/process (M)"]
    print("\n| " + " | ".join([*head, label, "packed / padded tok/s"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gain = (
            r["train_tokens_per_s"] / padded[r["backend"]]["train_tokens_per_s"]
            if r["packed"] and r["backend"] in padded
            else None
        )
        gain = "" if gain is None else f"{gain:.2f}x"
        print(
            f"| {r['backend']} | {'packed' if r['packed'] else 'padded'} | {r['processes']} | {r['step_s']:.1f} | "
            f"{r['train_s']:.1f} | {r['train_tokens_per_s']:.0f} | {r['generate_s']:.1f} | "
            f"{r['params_per_process_M']:.1f} | {r['peak_mb_per_process']:.0f} | {gain} |"
        )


if __name__ == "__main__":
    main()
