"""A rollout replica's process, from the outside: its command line, its environment (devices,
threads, token), starting it, waiting until it answers, and stopping it with everything it
started. Shared by `plait rollout-server` (server.py), the HF generation process of
asynchronous runs (hf_process.py) and the Ray launcher's generation actors. What runs inside
the process is server.py's `serve_replica`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from plait.auth import ENV


def command(spec: dict, replica: int, host: str, ports: list[int], limits: dict | None = None) -> list[str]:
    """The command line of one replica process (its token goes in its environment, not here)."""
    cmd = [sys.executable, "-m", "plait.rollout.server", json.dumps(spec), str(replica), host, json.dumps(ports)]
    return cmd + ([json.dumps(limits)] if limits else [])


def gpu_devices(replica: int, tp: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for one replica: its own `tp` GPUs out of the visible ones ({} without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[replica * tp : (replica + 1) * tp])}


def cpu_threads(replica: int, tp: int, dp: int) -> dict[str, str]:
    """On CPU, each of the dp x tp vLLM workers gets its own cores (VLLM_CPU_OMP_THREADS_BIND,
    one core list per TP rank): vLLM can't place several workers on one NUMA node by itself, and
    left alone it drops torch to one thread. The user's own settings win."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // (dp * tp))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(per))}
    if len(cores) >= dp * tp and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        ranks = [cores[(replica * tp + k) * per : (replica * tp + k + 1) * per] for k in range(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, r)) for r in ranks)
    return env


def pinning(replica: int, tp: int, dp: int) -> dict[str, str]:
    """Replica `replica`'s own share of this machine: its GPUs, or without CUDA its cores."""
    return gpu_devices(replica, tp) or cpu_threads(replica, tp, dp)


def start(
    spec: dict,
    replica: int,
    host: str,
    ports: list[int],
    token: str,
    env: dict[str, str] | None = None,
    limits: dict | None = None,
    **popen,
) -> subprocess.Popen:
    """Start one replica process in a session of its own (so `stop` reaches vLLM's engine and
    worker processes too), with `token` and `env` added to this process's environment."""
    full_env = {**os.environ, **(env or {}), ENV: token}
    return subprocess.Popen(command(spec, replica, host, ports, limits), env=full_env, start_new_session=True, **popen)


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Return once every URL answers /health; raise RuntimeError naming the replica when one of
    `procs` exits first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"replica {i} exited with code {p.returncode} while starting (its log is above)")
        try:
            httpx.get(pending[0] + "/health", timeout=2).raise_for_status()
            pending.pop(0)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pending[0]} did not become healthy within {timeout_s:.0f} s") from None
            time.sleep(0.5)


def stop(p: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM the replica's session, SIGKILL what is left of it after `grace_s`, reap it."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # vLLM's engine-core process of this replica, if it outlived it
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
