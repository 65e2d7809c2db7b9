"""Memory per step: host RSS (now, and the peak since the last step) and CUDA allocated/reserved."""

from __future__ import annotations

import resource
from pathlib import Path

import torch


_GB = 2**30


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_host_peak() -> bool:
    """Linux: writing 5 to clear_refs resets this process's peak RSS (VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """`take()` returns this step's memory figures and starts the next step's peak."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.per_step_peak = _reset_host_peak()  # else the peak is the run's so far (getrusage)

    def take(self) -> dict[str, float]:
        rss = _status_kb("VmRSS")
        peak = _status_kb("VmHWM") if self.per_step_peak else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        out = {"memory/rss_gb": (rss or 0) / 2**20, "memory/peak_rss_gb": peak / 2**20}
        if self.per_step_peak:
            _reset_host_peak()
        if self.cuda:
            out["memory/cuda_allocated_gb"] = torch.cuda.memory_allocated() / _GB
            out["memory/cuda_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / _GB
            out["memory/cuda_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / _GB
            torch.cuda.reset_peak_memory_stats()
        return out
