"""Resumable checkpoints: written to a temp folder, marked complete last, renamed into place.

Layout of one checkpoint, RUN_DIR/checkpoints/step_00000010/:
    model.safetensors   trainable weights (the whole model, or only LoRA's for a peft model)
    optimizer.pt        optimizer + LR scheduler state
    trainer_state.json  step, data position, RNG states (python, numpy, torch), metrics so far
    COMMITTED           written last; a folder without it is never loaded

A crash mid-save leaves only `step_X.tmp`, which `latest_checkpoint` ignores and the next
save removes. Retention deletes old checkpoints only after a newer one has committed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MARKER = "COMMITTED"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The tensors training changes: every parameter that requires grad (+ buffers for full models)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    full = len(names) == sum(1 for _ in model.parameters())
    state = model.state_dict()
    return _dedup(state if full else {k: v for k, v in state.items() if k in names})


def _dedup(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (tied embeddings): store each once."""
    seen, out = {}, {}
    for k, v in tensors.items():
        key = (v.data_ptr(), tuple(v.shape)) if v.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.detach().contiguous().clone()
    return out


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, state: dict, keep_last: int = 2, ref_model=None) -> Path:
    """Write step `step` atomically; `ref_model` too when given (it changes under reference sync)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model), str(tmp / "model.safetensors"))
    if ref_model is not None:
        save_file(_dedup(ref_model.state_dict()), str(tmp / "reference.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()}, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    (tmp / MARKER).write_text("ok\n")
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. resumed at it): replace atomically-ish
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(root, keep_last)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp") and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and stale temp folders."""
    done = complete_checkpoints(root.parent)
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    newest = int(done[-1].name.split("_")[1]) if done else -1
    for p in root.glob("step_*.tmp"):
        if int(p.name.split("_")[1].split(".")[0]) <= newest:
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, model, optimizer=None, scheduler=None, ref_model=None) -> dict:
    """Restore weights (and optimizer, scheduler, RNG when given); return trainer_state."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker): refusing to load it")
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise RuntimeError(f"checkpoint {path} has weights this model lacks: {unexpected[:5]}")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lost = [k for k in missing if k in trainable]  # tied copies aren't in named_parameters
    if lost:
        raise RuntimeError(f"checkpoint {path} lacks trained weights: {lost[:5]}")
    if ref_model is not None and (path / "reference.safetensors").is_file():
        ref_model.load_state_dict(load_file(str(path / "reference.safetensors")), strict=False)
    extra = torch.load(path / "optimizer.pt", weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(extra["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
    return json.loads((path / "trainer_state.json").read_text())
