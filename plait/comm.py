"""The collectives the training loop uses, each a no-op in a single process.

Every training process runs the same loop (SPMD). These helpers keep the loop free of
`if distributed:` branches: with one process they return their input unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def init_from_env(device: torch.device, timeout_s: float = 1800, single_process_ok: bool = False) -> bool:
    """Join the process group torchrun (or Ray) describes in the environment (RANK,
    WORLD_SIZE, MASTER_ADDR, ...). NCCL on GPUs, gloo on CPU. A process started directly
    gets a group of one when `single_process_ok` (FSDP2/DeepSpeed on one device, e.g. for
    offloading); otherwise it stays without a group."""
    if active():
        return True
    explicit: dict = {}  # explicit init arguments; none = env:// (torchrun's / Ray launcher's variables)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if not single_process_ok:
            return False
        if not all(v in os.environ for v in ("RANK", "MASTER_ADDR", "MASTER_PORT")):
            # under torchrun (even with one process) the group must use torchrun's store: its
            # TORCHELASTIC_USE_AGENT_STORE makes a tcp:// init a client of a store nobody serves
            explicit = {"init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and not explicit:
        # torchrun --max-restarts with its default (static) rendezvous keeps one store for every
        # attempt: without a prefix, a restarted rank can read the previous attempt's gloo/NCCL
        # addresses and connect to a dead peer
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        explicit = {"store": dist.PrefixStore(f"plait/attempt_{restart}", store), "rank": rank, "world_size": world}
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group(
            "nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=timeout_s), **explicit
        )
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s), **explicit)
    return True


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port, and the `span - 1` after it, free on this host now (on 127.0.0.1, or "" =
    every interface, for a port other nodes connect to).

    Chosen below the kernel's ephemeral range (where the source ports of outgoing connections
    and every port-0 bind come from, so a port picked there can be taken before its server
    binds it) and above Ray's worker ports (10002-19999 by default)."""
    import random
    import socket

    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, low - span))
        try:
            with contextlib.ExitStack() as held:
                for p in range(port, port + span):
                    s = held.enter_context(socket.socket())
                    s.bind((host, p))
            return port
        except OSError:
            continue
    with socket.socket() as s:  # nothing free below the ephemeral range: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


# Seconds this process spent in the collectives below (waiting for the slowest process
# included), for the per-step metrics. Gradient all-reduces inside DDP/FSDP/DeepSpeed's
# backward are not here: they overlap with compute and count in the train phase.
SECONDS = [0.0]


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not active():
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[0] += time.perf_counter() - t0

    return wrapper


def take_seconds() -> float:
    """Collective seconds since the last call."""
    out, SECONDS[0] = SECONDS[0], 0.0
    return out


def shutdown() -> None:
    if active():
        dist.barrier()
        dist.destroy_process_group()


@_timed
def barrier() -> None:
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    """Where collective tensors live: NCCL only moves GPU tensors."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@_timed
def all_sum(values: list[float]) -> list[float]:
    """Each number summed over processes (float64, so counts stay exact)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


@_timed
def all_max(values: list[float]) -> list[float]:
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@_timed
def all_gather_rows(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every process's `t` (same shape on all), concatenated along `dim` in rank order."""
    if not active():
        return t
    parts = [torch.empty_like(t, device=_comm_device()) for _ in range(world_size())]
    dist.all_gather(parts, t.to(_comm_device()).contiguous())
    return torch.cat(parts, dim=dim).to(t.device)


@_timed
def all_gather_objects(obj) -> list:
    """Every process's picklable `obj`, in rank order."""
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


@_timed
def broadcast_object(obj):
    """Rank 0's `obj` on every process."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
