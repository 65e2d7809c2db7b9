"""Rollouts at lower precision on CPU: how much faster they sample, and how far the sampling
log-probs move from the trainer's fp32 ones (the gap an importance-sampling correction would
have to carry).

    .venv/bin/python bench/rollout_precision.py [--model smollm2-135m-instruct] [--prompts 8]
                                                [--generations 8] [--tokens 32] [--demo] [--reps 1]

Each mode samples the same prompts (short arithmetic questions; with --demo the built-in demo's
own, worked examples included) with the HF engine, under plait's retained host memory as in a run:
`fp32 packed` (plait's default on CPU: oneDNN-packed weight copies), `fp32` (torch's matmul),
`bf16` (rollout.precision=bf16: oneDNN-packed bf16 copies of the linear weights, made on every
generate call as in a run and timed with it, the rest of the model in fp32), `bf16 autocast` (the
engine under torch's bf16 autocast, which casts the weights at every forward pass), `int8`
(rollout.precision=int8: fbgemm's dynamic quantization, int8 weights with a scale per output row,
activations quantized per tensor on each call, the output head kept fp32 packed; the weights are
packed again on every generate call, as in a run, and that time is counted) and `int8 torch.ao`
(torch.ao's quantize_dynamic: one scale per weight matrix, done once before timing). The trainer's
log-probs of every sampled token are recomputed with the fp32 model, one completion at a time; the
table gives the mean and largest |engine - trainer| log-prob over the sampled tokens and the KL of
the trainer from the engine (k3 estimate over those tokens). Say which CPU ran it (`lscpu`).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
import warnings

import torch

from plait.models import load_tokenizer, resolve_model_path
from plait.rollout.hf import HFEngine
from plait.train.hostmem import retained_host_memory
from plait.types import Prompt, SamplingParams


def int8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose nn.Linear layers but the head multiply in int8 (torch.ao's dynamic quantization)."""
    names = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor types deprecated
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), names, dtype=torch.qint8)


@torch.no_grad()
def trainer_gap(model, prompts: list[Prompt], groups) -> tuple[float, float, float]:
    """Mean and largest |engine - trainer| log-prob of the sampled tokens, and the k3 KL."""
    gaps = []
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([prompt.token_ids + c.token_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            ours = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(prompt.token_ids) - 1 :]
            gaps.append(ours - torch.tensor(c.logprobs))
    d = torch.cat(gaps)
    return float(d.abs().mean()), float(d.abs().max()), float((torch.expm1(d) - d).mean())


def plain_prompts(tok, n: int) -> list[Prompt]:
    """Short arithmetic questions, no worked examples."""
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = [{"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
        text = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
        prompts.append(Prompt(i, text, tok(text).input_ids))
    return prompts


def demo_prompts(tok, n: int) -> list[Prompt]:
    """The built-in demo's first training prompts, as its rounds sample them."""
    from plait.config import load_config
    from plait.data import build_prompts, load_rows

    cfg = load_config(None, [])
    return build_prompts(load_rows(cfg.data, "train", 0)[:n], tok, cfg.data, log=lambda *a: None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--demo", action="store_true", help="the built-in demo's prompts, worked examples included")
    ap.add_argument("--reps", type=int, default=1, help="timed calls per mode (the median is shown)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args.model)
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = demo_prompts(tok, args.prompts) if args.demo else plain_prompts(tok, args.prompts)
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1)
    rows = args.prompts * args.generations
    modes = {
        "fp32 packed": lambda: HFEngine(model, tok, batch_size=rows),
        "fp32": lambda: HFEngine(model, tok, batch_size=rows, packed_weights=False),
        "bf16": lambda: HFEngine(model, tok, batch_size=rows, precision="bf16"),
        "bf16 autocast": lambda: HFEngine(model, tok, batch_size=rows, precision="bf16", packed_weights=False),
        "int8": lambda: HFEngine(model, tok, batch_size=rows, precision="int8"),
        "int8 torch.ao": lambda: HFEngine(int8_copy(model), tok, batch_size=rows),
    }
    print(f"{args.model}, {rows} rows x {args.tokens} tokens, CPU with {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, ATen capability {torch.backends.cpu.get_cpu_capability()}\n")
    print("| mode | generate s | tokens/s | mean abs gap | max abs gap | KL (k3) |\n|---|---|---|---|---|---|")
    for name, make in modes.items():
        engine = make()
        times = []
        with retained_host_memory(True):  # as in a run
            engine.generate(prompts[:1], params, 2)  # warm-up
            for _ in range(args.reps):
                start = time.perf_counter()
                groups = engine.generate(prompts, params, args.generations)
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        mean, worst, kl = trainer_gap(model, prompts, groups)
        print(f"| {name} | {seconds:.2f} | {tokens / seconds:.0f} | {mean:.2g} | {worst:.2g} | {kl:.2g} |")


if __name__ == "__main__":
    main()
