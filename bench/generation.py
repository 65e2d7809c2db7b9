"""Generation throughput (HF engine vs vLLM) and weight-sync time per GB (colocated, server).

    .venv/bin/python bench/generation.py [--model smollm2-135m-instruct] [--prompts 8] [--n 8] [--tokens 64]
                                   [--precision fp32|bf16] [--reps 3] [--no-server]

Throughput: both engines sample the same prompts x n completions of up to --tokens tokens
(temperature 1, ignoring EOS is not possible in the HF engine, so tokens/s counts the tokens
actually generated), one warm-up call, then the median of --reps timed calls.
Weight sync: the trainer's full weights are copied into the engine --reps times after a
change (colocated: in-process reload; server: HTTP + bucketed gloo/NCCL broadcast + reload on a
`plait rollout-server` started here); seconds per GB of weights sent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from plait.comm import free_port
from plait.config import load_config
from plait.models import load_model, load_tokenizer, resolve_model_path
from plait.rollout import make_engine
from plait.types import Prompt, SamplingParams


def timed(fn, reps: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def throughput(engine, prompts, params, n, reps) -> tuple[float, float]:
    secs, out = timed(lambda: engine.generate(prompts, params, n), reps)
    tokens = sum(len(c.token_ids) for group in out for c in group)
    return secs, tokens / secs


def sync_per_gb(engine, model, reps) -> tuple[float, float]:
    """Median seconds per GB over `reps` syncs, each after a (tiny) weight change."""
    per_gb, gb = [], 0.0
    for v in range(1, reps + 2):
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
        t0 = time.perf_counter()
        engine.weights_for_round(v)
        secs = time.perf_counter() - t0
        gb = (
            engine.stats().get("weight_sync/gb")
            or sum(  # parameters(): tied ones once
                p.numel() * p.element_size() for p in model.parameters()
            )
            / 1e9
        )
        if v > 1:  # the first one pays for joining the weight group
            per_gb.append(secs / gb)
    return statistics.median(per_gb), gb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--quiet-server", action="store_true", help="drop the server's log")
    args = ap.parse_args()

    path = str(resolve_model_path(args.model))
    base = [
        f"model.name_or_path={path}",
        f"train.precision={args.precision}",
        f"rollout.batch_size={args.prompts * args.n}",
    ]
    tok = load_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(path, "float32").to(device)
    prompts = [
        Prompt(
            i,
            "",
            tok.apply_chat_template(
                [{"role": "user", "content": f"What is {i} + {7 * i}? Explain."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            ),
        )
        for i in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1)
    rows = []

    hf = make_engine(load_config(None, base), model, tok, device=device)
    secs, tps = throughput(hf, prompts, params, args.n, args.reps)
    rows.append(("hf", f"{secs:.2f}", f"{tps:.0f}", "-"))
    show(rows[-1])

    colo = make_engine(load_config(None, [*base, "rollout.engine=vllm"]), model, tok, device=device)
    secs, tps = throughput(colo, prompts, params, args.n, args.reps)
    per_gb, gb = sync_per_gb(colo, model, args.reps)
    rows.append(("vllm colocate", f"{secs:.2f}", f"{tps:.0f}", f"{per_gb:.2f} s/GB ({gb:.2f} GB)"))
    show(rows[-1])
    colo.close()
    del colo

    if not args.no_server:
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "plait",
                "rollout-server",
                "--set",
                f"model.name_or_path={path}",
                "--set",
                f"train.precision={args.precision}",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=open(os.devnull if args.quiet_server else "/dev/stderr", "w"),
        )
        try:
            cfg = load_config(
                None,
                [
                    *base,
                    "rollout.engine=vllm",
                    "rollout.vllm.mode=server",
                    f"rollout.vllm.servers=[http://127.0.0.1:{port}]",
                    "rollout.vllm.connect_timeout_s=600",
                ],
            )
            remote = make_engine(cfg, model, tok, device=device)
            remote.weights_for_round(0)
            secs, tps = throughput(remote, prompts, params, args.n, args.reps)
            per_gb, gb = sync_per_gb(remote, model, args.reps)
            rows.append(("vllm server (1 replica)", f"{secs:.2f}", f"{tps:.0f}", f"{per_gb:.2f} s/GB ({gb:.2f} GB)"))
            remote.close()
        finally:
            os.killpg(server.pid, 15)
            server.wait(60)

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\n{args.model}, {args.prompts} prompts x {args.n} completions x <= {args.tokens} tokens, "
        f"{args.precision}, {where}\n"
    )
    print("| engine | s per batch | tokens/s | weight sync |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def show(row) -> None:
    print("row:", " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
