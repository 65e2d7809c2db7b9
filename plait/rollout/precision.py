"""What a rollout engine samples in: rollout.precision, and how it ranks against the trainer's."""

# coarser to the right: the drift limit and the default correction follow the coarser side
PRECISIONS = ("fp32", "bf16", "int8")


def rollout_precision(cfg, device=None) -> str:
    """What the engine samples in, the one place rollout.precision=auto is decided.

    The HF engine on a CPU (device None: a CPU): bf16 where the CPU multiplies bf16 natively
    (AVX512_BF16 or AMX, kernels not capped to AVX2) and the engine packs its weights, else fp32.
    On a 2-core Zen 5 the demo's generation call took 1.43 s through packed bf16 weights against
    2.07 s in packed fp32, and three seeds learned at least as well with the gap corrected
    (docs/vs-trl.md); without native bf16 it is several times slower than fp32. Elsewhere: the
    trainer's precision."""
    p = cfg.rollout.precision
    if p != "auto":
        return p
    on_cpu = device is None or getattr(device, "type", device) == "cpu"
    if cfg.rollout.engine != "hf" or not on_cpu:
        return cfg.train.precision
    return "bf16" if packed_bf16_rollouts(cfg) else "fp32"


def packed_bf16_rollouts(cfg) -> bool:
    """auto's bf16 on a CPU: native bf16 units, and weights the engine packs (not with
    in-flight updates, which swap them mid-call, nor train.deterministic, which samples through
    MKL's reproducible fp32 matmul)."""
    from plait.models import native_bf16_cpu
    from plait.rollout.packed import bf16_packing_available

    r = cfg.rollout
    if not r.packed_weights or r.inflight_updates or cfg.train.deterministic:
        return False
    return native_bf16_cpu() and bf16_packing_available()


def coarser(a: str, b: str) -> str:
    return max(a, b, key=PRECISIONS.index)
