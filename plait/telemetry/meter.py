"""Per-step cost figures: throughput, MFU, memory and time in collectives, over all processes."""

from __future__ import annotations

from plait import comm
from plait.algo.logprobs import common_prefix
from plait.telemetry.flops import ModelCost
from plait.telemetry.memory import MemoryMeter
from plait.types import Group


# metrics that measure the machine (clocks, memory), not the training: they differ between two
# runs that are otherwise bitwise identical
MEASURED_PREFIXES = (
    "time/",
    "mfu/",
    "memory/",
    "comm/",
    "tokens/s_",
    "weight_sync/seconds",
    "async/generator_idle",
    "async/seconds_",
)


def is_measurement(key: str) -> bool:
    return key.startswith(MEASURED_PREFIXES) or key.endswith("/seconds")


class StepMeter:
    """`measure(...)` after each step's phases are timed: FLOPs this process did, summed over
    processes, against (the slowest process's phase time x processes x one device's peak)."""

    def __init__(self, cost: ModelCost | None, peak: float | None, memory: MemoryMeter, local_generation: bool):
        self.cost, self.peak, self.memory = cost, peak, memory
        self.local_generation = local_generation  # generation runs on the training devices (not a server)

    def flops(
        self, groups: list[Group], iterations: int, prepass_forwards: float, trained_share: float = 1.0
    ) -> dict[str, float]:
        """This process's useful model FLOPs per phase (each group's prompt counted once, and
        the beginning all the prompts share once for all of them);
        `trained_share`: the share of the loss tokens that went through forward and backward
        (rows with zero advantage can be left out of the update)."""
        if self.cost is None:
            return {}
        prompts = [len(g.prompt.token_ids) for g in groups]
        completions = [[len(c.token_ids) for c in g.completions] for g in groups]
        shared = common_prefix([g.prompt.token_ids for g in groups]) if len(groups) > 1 else 0
        out = {
            "train": trained_share * iterations * self.cost.train_groups(prompts, completions, shared),
            "logprobs": prepass_forwards * self.cost.forward_groups(prompts, completions, shared),
        }
        if self.local_generation:
            out["generate"] = self.cost.generate(prompts, completions, shared)
        return out

    def measure(self, flops: dict[str, float], trained_tokens: float, times: dict[str, float]) -> dict[str, float]:
        """`times`: the step's time/* (already the max over processes); `trained_tokens`: real
        tokens through forward+backward on this process (all passes)."""
        keys = sorted(flops)
        mine = [flops[k] for k in keys] + [trained_tokens]
        summed = comm.all_sum(mine)
        total, tokens = dict(zip(keys, summed[:-1])), summed[-1]
        out = {"tokens/s_train": tokens / max(1e-9, times.get("time/train", 0.0))}
        if self.peak:
            capacity = self.peak * comm.world_size()
            for phase, f in total.items():
                seconds = times.get(f"time/{phase}", 0.0)
                if seconds > 0 and f > 0:
                    out[f"mfu/{phase}"] = f / (seconds * capacity)
            out["mfu/step"] = sum(total.values()) / (max(1e-9, times["time/step"]) * capacity)
        out["flops/step"] = sum(total.values())
        mem = self.memory.take()
        mem["comm/seconds"] = comm.take_seconds()
        keys = sorted(mem)
        out.update(zip(keys, comm.all_max([mem[k] for k in keys])))  # the fullest / most-waiting process
        return out
