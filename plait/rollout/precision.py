"""What a rollout engine samples in: rollout.precision, and how it ranks against the trainer's."""

# coarser to the right: the drift limit and the default correction follow the coarser side
PRECISIONS = ("fp32", "bf16", "int8")


def rollout_precision(cfg, device=None) -> str:
    """What the engine samples in, the one place rollout.precision=auto is decided: fp32 for
    the HF engine on a CPU (device None: a CPU), else the trainer's precision. On CPUs plait's
    packed fp32 decoding is as fast as bf16 autocast where the CPU has bf16 units (Zen 5: 3.25
    vs 3.37 s for the same round, bench/rollout_precision.py) and several times faster where it
    has none, so bf16 training there still samples in fp32."""
    p = cfg.rollout.precision
    if p != "auto":
        return p
    on_cpu = device is None or getattr(device, "type", device) == "cpu"
    return "fp32" if cfg.rollout.engine == "hf" and on_cpu else cfg.train.precision


def coarser(a: str, b: str) -> str:
    return max(a, b, key=PRECISIONS.index)
