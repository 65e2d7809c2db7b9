"""`train.deterministic`: everything that can make two runs of one config differ, pinned, and
what cannot be, said.

Two runs of one config on one machine already repeat each other; what moves results
between machines and runs is the kernels' reduction order: which instruction set ATen, oneDNN
and MKL dispatch to (AVX-512 sums in other chunks than AVX2), MKL's choices by memory alignment
and thread count, and the number of threads splitting a reduction. The mode pins them:

- the kernels' instruction set, through environment variables read when the libraries load, so
  they are set before Python imports torch (`plait train` restarts itself with them once);
- the thread counts, written into the resolved config (so a rerun of RUN_DIR/config.yaml on a
  machine with other core counts uses the same);
- torch's deterministic algorithms (and cuDNN's, cuBLAS's workspace, NCCL's ring on a GPU).

Each round then also hashes what it computed (plait.train.hashes), so `plait diff` names the
stage where two runs part.
"""

from __future__ import annotations

import os
import platform
from contextlib import contextmanager
from typing import Iterator


# Read by the libraries when they load: set before torch is imported.
X86_PINS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorized kernels: the AVX2 build on every x86 CPU
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's JIT kernels
    # MKL's conditional numerical reproducibility (fixed cache sizes, deterministic reductions,
    # static scheduling; STRICT: no choices by memory alignment). COMPATIBLE is the one code
    # branch MKL honors on every x86 vendor: it documents its AVX2/AVX512 branches as Intel-only,
    # falling back to its default dispatch elsewhere without a warning.
    "MKL_CBWR": "COMPATIBLE,STRICT",
}
COMMON_PINS = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS: fixed workspaces (torch's deterministic mode asks for it)
    "NCCL_ALGO": "Ring",  # NCCL: one reduction algorithm and protocol whatever the message size
    "NCCL_PROTO": "Simple",
    "PYTHONHASHSEED": "0",  # set iteration order in user code (reward functions)
}


def pinned_environment(machine: str | None = None) -> dict[str, str]:
    """The environment variables the mode sets (the ISA caps only on x86 CPUs)."""
    machine = (machine or platform.machine()).lower()
    x86 = machine in ("x86_64", "amd64", "i686", "i386")
    return {**(X86_PINS if x86 else {}), **COMMON_PINS}


def separate_kernel_cache(environ=os.environ) -> None:
    """Under a capped instruction set (ATEN_CPU_CAPABILITY, as this mode and the test suite's
    AVX2 pass set it), compile kernels into a cache of that cap's own. torch inductor's graph cache
    does not key on the cap: a graph compiled with AVX-512 vectors was loaded under the AVX2 cap
    and its kernel rebuilt with 8-wide vectors in loops stepping by 16, leaving every other block
    of the output garbage (vLLM's tensor-parallel embedding lookup then read past its table).
    A TORCHINDUCTOR_CACHE_DIR already set is left as it is."""
    cap = environ.get("ATEN_CPU_CAPABILITY")
    if not cap or "TORCHINDUCTOR_CACHE_DIR" in environ:
        return
    import tempfile

    try:
        import getpass

        user = getpass.getuser()
    except (KeyError, OSError, ImportError):  # no passwd entry (some containers)
        user = str(os.getuid())
    # torch's own default (torchinductor_<user> in the temp folder) with the cap added, named
    # here so that the command line loads no torch for it
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{user}_{cap.lower()}")
    environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{safe}")


def missing_pins(environ=os.environ) -> dict[str, str]:
    """Pins not in `environ` yet (or set to another value)."""
    return {k: v for k, v in pinned_environment().items() if environ.get(k) != v}


@contextmanager
def deterministic_process(cfg, device_type: str) -> Iterator[list[str]]:
    """Pin what can be pinned inside this process, for the run (torch's global flags are put
    back after it); yields lines for the run header: what was pinned, and what could not be."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.mkldnn.deterministic)
    torch.set_num_threads(cfg.train.threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.mkldnn.deterministic = True
    if device_type == "cuda":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield [*pinned_lines(torch.backends.cpu.get_cpu_capability(), cfg.train.threads, device_type), *unpinnable(cfg)]
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.mkldnn.deterministic = before[1]


def pinned_lines(capability: str, threads: int, device_type: str) -> list[str]:
    lines = []
    missing = missing_pins()
    if missing:
        names = " ".join(f"{k}={v}" for k, v in missing.items())
        lines.append(
            f"[yellow]not pinned: {names} (torch was loaded before they were set: start through `plait train`, "
            "which sets them, or export them before Python starts)"
        )
    if "ATEN_CPU_CAPABILITY" in pinned_environment():
        if capability == "AVX2":
            lines.append(
                "kernels pinned: ATen and oneDNN to their AVX2 code paths, MKL to its conditional-reproducibility "
                "COMPATIBLE branch (rounds about 2x slower on CPU: docs/reproducibility.md#cost)"
            )
        elif capability in ("DEFAULT", "AVX"):
            lines.append(
                f"[yellow]this CPU has no AVX2 (ATen runs its {capability} kernels): it repeats only CPUs alike"
            )
    lines.append(f"threads pinned to {threads} per process (runs compare bit for bit at the same count)")
    lines.append("torch deterministic algorithms on")
    if device_type == "cuda":
        lines.append("GPU: cuDNN and cuBLAS deterministic, NCCL ring; kernels that are not batch invariant stay so")
    return lines


def unpinnable(cfg) -> list[str]:
    """What the mode cannot pin in this config, for the run header."""
    notes = []
    if cfg.rollout.engine == "vllm":
        notes.append(
            "vLLM batches requests as they arrive: its batch composition, and so its rounding, is not pinned "
            "(on GPUs vLLM's VLLM_BATCH_INVARIANT=1 selects batch-invariant kernels where it has them)"
        )
        if cfg.rollout.vllm.mode == "server":
            notes.append("the rollout server repeats only if it runs in this mode on a machine alike")
    if cfg.train.precision == "bf16":
        notes.append("bf16 on CPU runs oneDNN kernels, whose blocking may follow the CPU's caches: pinned per machine")
    notes.append(
        "a reward or tool call that reaches its time limit (rewards[].timeout_s, sandboxed code) "
        "depends on the machine's load"
    )
    return notes
