"""Where a run writes, and whether it starts fresh or continues a checkpoint."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from plait import comm
from plait.checkpoint import ROLLOUTS, find_checkpoint, latest_checkpoint
from plait.config import ConfigError


def run_name(cfg) -> str:
    """`name`, else the data's (the built-in task, the prompt file's stem, or the first
    environment and how many more) and the model's."""
    if cfg.name:
        return cfg.name
    data = cfg.data.task or Path(cfg.data.path or "data").stem
    if cfg.environments:
        labels = [e.label for e in cfg.environments]
        data = labels[0] + (f"+{len(labels) - 1}" if len(labels) > 1 else "")
    return f"{data}-{Path(cfg.model.name_or_path.rstrip('/')).name}"


def default_run_dir(cfg) -> Path:
    """output_dir, else runs/NAME-TIMESTAMP."""
    return Path(cfg.output_dir or f"runs/{run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}")


def prepare_run_dir(cfg) -> tuple[Path, Path | None]:
    """The run directory, and the checkpoint to resume from (None for a fresh start): rank 0
    decides (its clock names a new run), every process gets the same answer."""
    decided = None
    if comm.is_main():
        try:
            decided = _choose_run_dir(cfg)
            if decided[1] is not None:
                refuse_another_process_count(decided[1], comm.world_size())
        except ConfigError as err:
            decided = err.problems
    decided = comm.broadcast_object(decided)
    if isinstance(decided, list):
        raise ConfigError(decided)
    return decided


def _choose_run_dir(cfg) -> tuple[Path, Path | None]:
    if cfg.resume not in ("never", "auto"):
        ckpt = find_checkpoint(Path(cfg.resume))  # validate() made sure there is one
        return ckpt.parent.parent, ckpt
    run_dir = default_run_dir(cfg)
    existing = latest_checkpoint(run_dir)
    if restarted_by_torchrun() and cfg.output_dir:  # torchrun --max-restarts started us again: continue
        return run_dir, existing
    if existing is not None and cfg.resume == "never":
        raise ConfigError(
            [
                f"output_dir '{run_dir}' already holds checkpoints (newest: {existing.name}); "
                f"continue it with `plait train --resume {run_dir}`, or choose another output_dir"
            ]
        )
    return run_dir, existing if cfg.resume == "auto" else None


def restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def refuse_another_process_count(checkpoint: Path, processes: int) -> None:
    """An asynchronous run's checkpoint holds the rounds generated ahead, split per training
    process: it resumes with the process count that wrote it, refused before the run directory
    is touched."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    ahead = state.get("rollouts_ahead", [None] if (checkpoint / ROLLOUTS).is_file() else [])
    wrote = state.get("world_size", 1)
    if ahead and wrote != processes:
        raise ConfigError(
            [
                f"{checkpoint} holds {len(ahead)} round(s) generated ahead for {wrote} training process(es), "
                f"but {processes} were launched: resume it with {wrote}; to change the count, resume it with {wrote} "
                f"and rollout.max_staleness=0 until its next checkpoint (a synchronous checkpoint holds no rounds "
                f"ahead), then with {processes}"
            ]
        )
