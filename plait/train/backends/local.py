"""One process (`local`), and replicated weights with all-reduced gradients (`ddp`).

Both keep a full copy of the model in every process, so both write the same checkpoint:
rank 0 saves `model.safetensors` (+ `reference.safetensors`) and `optimizer.pt`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plait import comm
from plait.algo.kl import mix_reference
from plait.models import autocast, kept_casts, load_model, save_model
from plait.train.backends.base import StepOutcome
from plait.train.optim import make_optimizer


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The tensors training changes: every parameter that requires grad (+ buffers for full models)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    full = len(names) == sum(1 for _ in model.parameters())
    state = model.state_dict()
    return dedup(state if full else {k: v for k, v in state.items() if k in names})


def dedup(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def load_trainable(model, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Load saved trainable weights, refusing files that lack one or carry unknown ones."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise RuntimeError(f"checkpoint {where} has weights this model lacks: {unexpected[:5]}")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lost = [k for k in missing if k in trainable]  # tied copies aren't in named_parameters
    if lost:
        raise RuntimeError(f"checkpoint {where} lacks trained weights: {lost[:5]}")


def held_teacher(cfg) -> bool:
    """The training processes hold the teacher (teacher.site=trainer)."""
    return cfg.teacher is not None and cfg.teacher.site == "trainer"


def _to_cpu(tree):
    """A copy of a (nested) state dict with every tensor on the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return copy.deepcopy(tree)


class LocalBackend:
    """The whole model, its gradients and optimizer state in this one process."""

    name = "local"
    shares_prompt_pass = True  # one process: nothing hooks a forward to a backward
    async_save = True

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.precision = cfg.train.precision
        self.device = torch.device(device)
        self.model = self.module = self.ref_model = self.teacher_model = self.optimizer = self.scheduler = None
        self.ref_sync_steps, self.ref_mixup_alpha = cfg.algo.ref_model_sync_steps, cfg.algo.ref_model_mixup_alpha

    @classmethod
    def wrap(cls, model, optimizer=None, scheduler=None, ref_model=None, precision: str = "fp32"):
        """A backend around objects built elsewhere (tests, tools)."""
        self = cls.__new__(cls)
        self.cfg, self.precision = None, precision
        self.device = next(model.parameters()).device
        self.model = self.module = model
        self.ref_model, self.optimizer, self.scheduler = ref_model, optimizer, scheduler
        self.teacher_model = None
        self.ref_sync_steps, self.ref_mixup_alpha = 0, 1.0
        return self

    # ------------------------------------------------------------ setup

    def load(self, cfg) -> None:
        m = cfg.model
        self.module = load_model(m.name_or_path, m.dtype, m.lora, m.gradient_checkpointing).to(self.device)
        self.module.train()
        self.model = self._wrap(self.module)
        # beta = 0 loads no reference model; with LoRA the reference is the base model itself
        if cfg.algo.beta > 0 and cfg.model.lora is None:
            self.ref_model = copy.deepcopy(self.module).eval().requires_grad_(False)
        if held_teacher(cfg):
            t = cfg.teacher
            self.teacher_model = load_model(t.name_or_path, t.dtype or m.dtype).to(self.device).eval()
            self.teacher_model.requires_grad_(False)
        self.optimizer, self.scheduler = make_optimizer(self.module, cfg)

    def _wrap(self, module):
        return module

    def describe(self) -> dict:
        """What this process holds, for the run log and cluster.json."""
        n = sum(p.numel() for p in self.module.parameters())
        return {"backend": self.name, "params_local": n, "params_total": n}

    # ------------------------------------------------------------ one optimizer step

    def autocast(self):
        """Mixed precision for forward passes (train.precision)."""
        return autocast(self.device, self.precision)

    def keep_casts(self):
        """Around an update's micro-batches: the weights' bf16 casts made once (models.kept_casts)."""
        return kept_casts(self.device, self.precision)

    def accumulate(self, last: bool):
        """Context around one micro-batch's forward and backward; `last` ends the step."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # the loss is normalized by the whole step's counts over all processes, so the
        # gradient we want is the sum over processes; DDP and FSDP average, hence x world size
        (loss * comm.world_size()).backward()

    def step(self, max_norm: float | None) -> StepOutcome:
        """Clip the gradient norm and take the optimizer step. A non-finite norm skips it
        (weights, AdamW moments and LR schedule untouched); the norm is the same in every
        process (gradients are reduced first), so all of them skip together."""
        lr = self.scheduler.get_last_lr()[0]
        norm = self._clip(max_norm)
        applied = math.isfinite(norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(applied, norm, lr, applied and self._after_update())

    def _clip(self, max_norm: float | None) -> float:
        """Clip the gradients to `max_norm` (None: measure only); the pre-clip total norm."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf")))

    def _after_update(self) -> bool:
        """Advance the LR schedule; every `ref_model_sync_steps` updates mix the policy into
        the reference. Returns whether the reference was synced."""
        self.scheduler.step()
        due = self.ref_sync_steps and self.scheduler.last_epoch % self.ref_sync_steps == 0
        if due:
            mix_reference(self.ref_model, self.module, self.ref_mixup_alpha)
        return bool(due)

    @contextlib.contextmanager
    def for_generation(self):
        """A context yielding the module the rollout engine samples from. Re-entrant: the
        loop opens it once around a step's sampling, so the (collective) gather of sharded
        weights happens once per step in every process, however many generation rounds each
        process then runs on its own (dynamic sampling, two-stage)."""
        if getattr(self, "_generation_view", None) is not None:
            yield self._generation_view
            return
        with self._gather_for_generation() as view:
            self._generation_view = view
            try:
                yield view
            finally:
                self._generation_view = None

    def _gather_for_generation(self):
        return contextlib.nullcontext(self.module)  # the training weights themselves

    # ------------------------------------------------------------ checkpoints

    def save_state(self, folder: Path) -> None:
        if not comm.is_main():  # every process holds the same weights
            return
        save_file(trainable_state(self.module), str(folder / "model.safetensors"))
        if self.ref_model is not None:
            save_file(dedup(self.ref_model.state_dict()), str(folder / "reference.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict()}, folder / "optimizer.pt")

    def save_state_async(self, folder: Path):
        """Copy the state to CPU now; the returned function writes it (rank 0's copy only)."""
        if not comm.is_main():
            return lambda: None
        model = {k: v.cpu() for k, v in trainable_state(self.module).items()}  # trainable_state copies
        ref = (
            {k: v.cpu() for k, v in dedup(self.ref_model.state_dict()).items()} if self.ref_model is not None else None
        )
        optim = _to_cpu(self.optimizer.state_dict())

        def write() -> None:
            save_file(model, str(folder / "model.safetensors"))
            if ref is not None:
                save_file(ref, str(folder / "reference.safetensors"))
            torch.save({"optimizer": optim}, folder / "optimizer.pt")

        return write

    def load_state(self, folder: Path) -> None:
        load_trainable(self.module, load_file(str(folder / "model.safetensors")), folder)
        if self.ref_model is not None and (folder / "reference.safetensors").is_file():
            self.ref_model.load_state_dict(load_file(str(folder / "reference.safetensors")), strict=False)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False)["optimizer"])

    def export(self, path: Path, tokenizer) -> None:
        """A plain HF folder (LoRA merged) written by rank 0."""
        if comm.is_main():
            save_model(self.module, tokenizer, path)
        comm.barrier()


class DDPBackend(LocalBackend):
    """Every process holds the whole model; gradients are all-reduced in backward (once per
    optimizer step: earlier micro-batches skip the sync)."""

    name = "ddp"
    shares_prompt_pass = False  # DDP hooks one forward to one backward

    def _wrap(self, module):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = (
            [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            if self.device.type == "cuda"
            else None
        )
        return DDP(module, device_ids=ids)

    def keep_casts(self):
        """Around an update's micro-batches: the weights' bf16 casts made once (models.kept_casts)."""
        return kept_casts(self.device, self.precision)

    def accumulate(self, last: bool):
        # DDP reads the sync flag in forward, so the context spans forward and backward
        return contextlib.nullcontext() if last else self.model.no_sync()
