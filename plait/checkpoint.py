"""Resumable checkpoints: written to a temp folder, marked complete last, renamed into place.

Layout of one checkpoint, RUN_DIR/checkpoints/step_00000010/:
    model.safetensors, optimizer.pt   local / ddp: weights and optimizer state (rank 0)
    dcp/                              fsdp2: torch.distributed.checkpoint shards (every rank)
    deepspeed/                        deepspeed: ZeRO partitions (every rank)
    scheduler.pt                      LR schedule (identical on every rank)
    rng_<rank>.pt                     each process's RNG states (python, numpy, torch, cuda)
    trainer_state.json                step, data position per process, backend, world size
    rollouts.pt                       asynchronous runs: rounds generated ahead, with their versions
    COMMITTED                         written last; a folder without it is never loaded

Every process writes its part into `step_X.tmp`; after a barrier rank 0 commits (marker,
fsync, rename). A crash mid-save leaves only `step_X.tmp`, which `latest_checkpoint` ignores
and the next save removes. Retention deletes old checkpoints only after a newer one has
committed. With several nodes, the run directory must be on storage every node sees.

Asynchronous saves (checkpoint.async_save, local/ddp/fsdp2): the state is copied to CPU
memory while training waits, and the write, fsync and commit happen on a background thread
while the next step runs. A save waits for the previous one to commit first; the end of the
run (and a stop signal) waits too. A crash before the commit leaves a `.tmp` folder, never a
checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from plait import comm
from plait.types import round_of


MARKER = "COMMITTED"
ROLLOUTS = "rollouts.pt"  # asynchronous runs: the rounds generated ahead of the trainer


class CheckpointDamaged(RuntimeError):
    """A committed checkpoint whose files no longer match what was committed (damage())."""


def load_rollouts(path: Path) -> list:
    """The rounds an asynchronous run had generated ahead when checkpoint `path` was written
    ([] for a synchronous run's checkpoint)."""
    f = Path(path) / ROLLOUTS
    return torch.load(f, weights_only=False) if f.is_file() else []


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        _fsync_dir(d)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Background:
    """The one save still being written in this process (None when none)."""

    thread: threading.Thread | None = None
    error: BaseException | None = None

    @classmethod
    def start(cls, work: Callable[[], None]) -> None:
        def run():
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - re-raised by wait()
                cls.error = err

        cls.thread = threading.Thread(target=run, name="plait-checkpoint", daemon=False)
        cls.thread.start()

    @classmethod
    def wait(cls) -> None:
        if cls.thread is not None:
            cls.thread.join()
            cls.thread = None
        if cls.error is not None:
            err, cls.error = cls.error, None
            raise RuntimeError(f"writing a checkpoint in the background failed: {err}") from err


def wait_for_saves() -> None:
    """Block until this process's background save (if any) is written and committed."""
    _Background.wait()


def save_checkpoint(
    run_dir: Path,
    step: int,
    backend,
    state: dict,
    keep_last: int = 2,
    blocking: bool = True,
    rollouts: list | None = None,
) -> Path:
    """Write step `step` atomically. Every process calls this (the backend's save is a
    collective); `state` is the trainer state, taken from rank 0, and `rollouts` the rounds an
    asynchronous run generated ahead (rank 0's). With blocking=False and a backend that can
    (`backend.async_save`), return once the state is copied, and write and commit it in the
    background."""
    wait_for_saves()  # the previous save commits first: retention counts on it
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if comm.is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    comm.barrier()
    if blocking or not backend.async_save:
        backend.save_state(tmp)
        finish = None
    else:
        finish = backend.save_state_async(tmp)  # state copied; `finish()` writes it
    torch.save(rng_state(), tmp / f"rng_{comm.rank()}.pt")
    if comm.is_main():
        torch.save(backend.scheduler.state_dict(), tmp / "scheduler.pt")
        info = {"step": step, "backend": backend.name, "world_size": comm.world_size(), **state}
        if rollouts is not None:
            torch.save(rollouts, tmp / ROLLOUTS)
            info["rollouts_ahead"] = [r.step for r in rollouts]
        (tmp / "trainer_state.json").write_text(json.dumps(info, indent=1))
    comm.barrier()  # every process's files are written (async: its state is copied)
    if finish is None:
        if comm.is_main():
            _commit(tmp, final, keep_last)
        comm.barrier()
    else:
        # rank 0's finish() returns once every process's shards are written (DCP gathers
        # their results to write its metadata; local/ddp: only rank 0 writes)
        _Background.start((lambda: (finish(), _commit(tmp, final, keep_last))) if comm.is_main() else finish)
    return final


def _commit(tmp: Path, final: Path, keep_last: int) -> None:
    """Rank 0: make `tmp` durable, mark it complete, rename it into place, prune."""
    _fsync_tree(tmp)
    # the marker lists every file's size: a checkpoint the storage later truncated or lost a
    # file of is told apart from a complete one before a resume reads it (damage())
    sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    (tmp / MARKER).write_text(json.dumps({"files": sizes}, indent=0) + "\n")
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. resumed at it): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    prune(final.parent, keep_last)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp") and (p / MARKER).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def find_checkpoint(path: Path) -> Path | None:
    """`path` itself when it is a complete checkpoint, else the newest one in run dir `path`."""
    path = Path(path)
    return path if (path / MARKER).is_file() else latest_checkpoint(path)


def damage(path: Path) -> str | None:
    """What is missing or cut short in complete checkpoint `path` against the sizes its marker
    recorded when it was committed (None: all there; a marker without sizes is not checked)."""
    try:
        files = json.loads((Path(path) / MARKER).read_text())["files"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    for name, size in files.items():
        f = Path(path) / name
        if not f.is_file():
            return f"{name} is missing"
        if (now := f.stat().st_size) != size:
            return f"{name} holds {now:,} bytes, {size:,} when it was written"
    return None


def checkpoint_run(path: Path) -> Path | None:
    """The run directory of `path` when it is a complete checkpoint (RUN/checkpoints/step_N
    with its marker, RUN/config.yaml beside), else None."""
    run = Path(path).parent.parent
    return run if (Path(path) / MARKER).is_file() and (run / "config.yaml").is_file() else None


def checkpoint_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The policy's weights in a complete checkpoint, on the CPU in one process, whichever
    backend wrote it, named as the model's own state_dict (a LoRA checkpoint of the local and
    DDP backends holds the adapters only)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "dcp").is_dir():  # FSDP2's shards, gathered: torch's own reader, no process group needed
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(path / "dcp"))
        meta = reader.read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
        with warnings.catch_warnings():  # that it reads in one process is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
        return {k.removeprefix("model."): v for k, v in state.items()}
    if (path / "deepspeed").is_dir():  # ZeRO partitions, merged by DeepSpeed's own zero_to_fp32
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path / "deepspeed"), tag="state"))
    raise FileNotFoundError(f"{path} holds no model weights plait knows (model.safetensors, dcp/ or deepspeed/)")


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and stale temp folders."""
    done = complete_checkpoints(root.parent)
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    newest = int(done[-1].name.split("_")[1]) if done else -1
    for p in root.glob("step_*.tmp"):
        if int(p.name.split("_")[1].split(".")[0]) <= newest:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, backend) -> dict:
    """Restore weights, optimizer, LR schedule and this process's RNG; return trainer_state."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker): refusing to load it")
    why = damage(path)
    if why:
        raise CheckpointDamaged(
            f"checkpoint {path} is damaged: {why} (it was whole when committed: the storage lost part of it since); "
            "nothing was loaded from it"
        )
    state = json.loads((path / "trainer_state.json").read_text())
    backend.load_state(path)
    if backend.scheduler is not None:
        backend.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / f"rng_{comm.rank()}.pt"
    if rng.is_file():  # absent when resuming with more processes than wrote it
        set_rng_state(torch.load(rng, weights_only=False))
    return state


def resume_position(state: dict, rank: int, world: int, say) -> int:
    """This process's data position in a checkpoint. With another number of processes than
    wrote it, every process restarts from the furthest position all of them had reached."""
    per_rank = state.get("prompts_consumed_per_rank") or [state["prompts_consumed"]]
    if len(per_rank) == world:
        return per_rank[rank]
    reached = min(per_rank) * len(per_rank)
    if rank == 0:
        say(
            f"[yellow]resuming with {world} processes a checkpoint written by {len(per_rank)}: "
            f"data continues at prompt position {reached - reached % world}"
        )
    return reached // world


def checkpoint_step(path: Path) -> int:
    """The round a checkpoint folder (step_00000010) was saved after."""
    return int(Path(path).name.removeprefix("step_"))


def _written_before(row: dict, step: int) -> bool:
    """Was this log record written before the checkpoint of round `step` committed? Rounds up to
    it log first; the evaluation before training (step 0) and after it (tag "after") run again
    when a run restarts from scratch or from its last checkpoint."""
    return step > 0 and round_of(row) <= step and row.get("tag") != "after"


def trim_logs(run_dir: Path, step: int) -> int:
    """On a (re)start from round `step` (0: from scratch): keep the lines of metrics/samples/
    eval/hashes.jsonl up to `step` (the rounds after it run again and log again; so does the final
    evaluation, written after the last checkpoint) and drop a line a crash cut short. Returns
    lines dropped."""
    dropped = 0
    for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl", "hashes.jsonl"):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict) and _written_before(row, step):
                kept.append(line)
            else:
                dropped += 1
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, path)
    return dropped
