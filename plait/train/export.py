"""A checkpoint as a model folder: RUN/checkpoints/step_N -> step_N/model, loadable by
`from_pretrained`, `plait eval` and `model.name_or_path`."""

from __future__ import annotations

from pathlib import Path

from plait.checkpoint import checkpoint_model_weights, checkpoint_run
from plait.config import load_config
from plait.models import load_model, load_tokenizer, save_model
from plait.train.backends.local import load_trainable


def model_folder(name_or_path: str) -> str:
    """`name_or_path` itself, or for a complete checkpoint the model folder written from it
    (once: `export_checkpoint`)."""
    path = Path(name_or_path)
    if checkpoint_run(path) is None:
        return name_or_path
    folder = path / "model"
    return str(folder if (folder / "config.json").is_file() else export_checkpoint(path))


def export_checkpoint(path: Path) -> Path:
    """Write checkpoint `path`'s policy as a plain HF folder, `path`/model (LoRA merged), from
    the run's base model (RUN/config.yaml) and the checkpoint's weights in whichever format its
    backend wrote; return the folder."""
    cfg = load_config(str(checkpoint_run(path) / "config.yaml"))
    model = load_model(cfg.model.name_or_path, cfg.model.dtype, cfg.model.lora)
    load_trainable(model, checkpoint_model_weights(path), path)
    return save_model(model, load_tokenizer(cfg.model.name_or_path), path / "model")
