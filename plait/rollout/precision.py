"""What a rollout engine samples in: rollout.precision, and how it ranks against the trainer's."""

from plait.models import native_bf16_cpu


# coarser to the right: the drift limit and the default correction follow the coarser side
PRECISIONS = ("fp32", "bf16", "int8")


def rollout_precision(cfg, device=None) -> str:
    """What the engine samples in, the one place rollout.precision=auto is decided: the trainer's
    precision, except for the HF engine on a CPU (device None: a CPU) without bf16 units, which
    samples in fp32 whatever the trainer runs in (bf16 products there are several times slower
    than fp32's; bench/rollout_precision.py with the kernels capped to AVX2: 18.8 s against 4.6 s
    for the demo's call).

    On a CPU with AVX512_BF16 or AMX, train.precision=auto is bf16 and the rollouts follow it
    through packed bf16 weights (docs/vs-trl.md, "auto"). bf16 products round differently with the
    number of rows a call multiplies, so such a run split over two processes does not sample the
    tokens one process samples, and its engine's log-probs are within bf16's rounding of the
    trainer's, not 1e-5: train.precision=fp32 keeps both."""
    p = cfg.rollout.precision
    if p != "auto":
        return p
    on_cpu = device is None or getattr(device, "type", device) == "cpu"
    if cfg.rollout.engine == "hf" and on_cpu:
        return "bf16" if cfg.train.precision == "bf16" and native_bf16_cpu() else "fp32"
    return cfg.train.precision


def coarser(a: str, b: str) -> str:
    return max(a, b, key=PRECISIONS.index)
