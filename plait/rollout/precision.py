"""What a rollout engine samples in: rollout.precision, and how it ranks against the trainer's."""

# coarser to the right: the drift limit and the default correction follow the coarser side
PRECISIONS = ("fp32", "bf16", "int8")


def rollout_precision(cfg, device=None) -> str:
    """What the engine samples in, the one place rollout.precision=auto is decided: fp32 for
    the HF engine on a CPU (device None: a CPU), else the trainer's precision.

    CPUs stay at fp32 even where bf16 is faster (rollout.precision=bf16: the demo's generation
    call 1.52 s against 2.12 s on a Zen 5 with AVX512_BF16, bench/rollout_precision.py --demo;
    several times slower without it):
    fp32 rollouts sample the trainer's own policy (log-probs within 1e-5), and bf16 products
    round differently with the number of rows a call multiplies, so a run split over two
    processes would no longer sample the tokens one process samples (27 tests of that and of
    exact sampling failed with bf16 as the default). The end-of-run advice names bf16 where the
    CPU has it."""
    p = cfg.rollout.precision
    if p != "auto":
        return p
    on_cpu = device is None or getattr(device, "type", device) == "cpu"
    return "fp32" if cfg.rollout.engine == "hf" and on_cpu else cfg.train.precision


def coarser(a: str, b: str) -> str:
    return max(a, b, key=PRECISIONS.index)
