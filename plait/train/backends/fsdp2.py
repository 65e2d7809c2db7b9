"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state
sharded over the processes; each decoder layer gathers its weights just for its forward and
backward. Checkpoints are torch.distributed.checkpoint folders: every process writes its own
shards, and DCP can read them back with a different number of processes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from plait import comm
from plait.models import save_model
from plait.train.backends.local import LocalBackend, held_teacher
from plait.train.optim import make_optimizer


def shard_units(model) -> list[torch.nn.Module]:
    """The modules to shard one by one: the model's decoder layers (the classes transformers
    lists as `_no_split_modules`), so only one layer's full weights exist at a time."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise RuntimeError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules); fsdp2 can't shard it per layer"
        )
    return units


class FSDP2Backend(LocalBackend):
    name = "fsdp2"
    shares_prompt_pass = False  # FSDP2 gathers each layer for one forward and its backward
    _save_group = None  # gloo group for background checkpoint writes (made at the first async save)

    def _policies(self) -> dict:
        f = self.cfg.train.fsdp
        kw: dict = {"reshard_after_forward": f.reshard_after_forward}
        if self.precision == "bf16":  # gather and compute in bf16, reduce gradients in fp32
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if f.cpu_offload and self.device.type == "cuda":
            kw["offload_policy"] = CPUOffloadPolicy()
        if self.device.type == "cuda":
            from torch.distributed.device_mesh import init_device_mesh

            kw["mesh"] = init_device_mesh("cuda", (comm.world_size(),))
        return kw

    def _shard(self, module):
        """Shard layer by layer, then the rest (embeddings, norm, head) at the root."""
        kw = self._policies()
        for unit in shard_units(module):
            fully_shard(unit, **kw)
        fully_shard(module, **kw)
        return module

    def load(self, cfg) -> None:
        m = cfg.model
        self.module = self._load_sharded(m.gradient_checkpointing)
        self.module.train()
        self.model = self.module
        if cfg.algo.beta > 0:
            self.ref_model = self._load_sharded(False).eval().requires_grad_(False)
        if held_teacher(cfg):
            t = cfg.teacher
            self.teacher_model = self._load_sharded(False, t.name_or_path, t.dtype).eval().requires_grad_(False)
        self.optimizer, self.scheduler = make_optimizer(self.module, cfg)

    def _load_sharded(self, gradient_checkpointing: bool, name_or_path: str | None = None, dtype: str | None = None):
        """Only rank 0 reads the weights; the others build the model on the meta device (no
        memory), everyone shards it, and rank 0 broadcasts each weight into the shards. So one
        process, not N, holds a full CPU copy while loading, and a GPU never holds more than
        its shards plus one layer."""
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        from plait.models import DTYPES, enable_activation_checkpointing, load_model, resolve_model_path

        m = self.cfg.model
        name_or_path, dtype = name_or_path or m.name_or_path, dtype or m.dtype  # the policy's unless said
        if comm.is_main():
            module = load_model(name_or_path, dtype, None, gradient_checkpointing)
            full = module.state_dict()
        else:
            folder = resolve_model_path(name_or_path)
            with torch.device("meta"):
                module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=DTYPES[dtype])
            if (folder / "generation_config.json").is_file():
                module.generation_config = GenerationConfig.from_pretrained(folder)
            module.generation_config.pad_token_id = module.generation_config.pad_token_id or module.config.eos_token_id
            if gradient_checkpointing:
                enable_activation_checkpointing(module)
            full = {}
        self._shard(module)
        if not comm.is_main():
            module.to_empty(device=self.device)
        set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
        for b in module.buffers():  # buffers are not sharded; non-persistent ones (rotary) aren't in the state dict
            torch.distributed.broadcast(b.data, src=0)
        return module

    def describe(self) -> dict:
        local = sum(p.to_local().numel() for p in self.module.parameters())
        total = sum(p.numel() for p in self.module.parameters())
        return {"backend": self.name, "params_local": local, "params_total": total}

    def keep_casts(self):
        # FSDP2 gathers each weight anew for every forward: a kept cast would hold the gathered one
        return contextlib.nullcontext()

    def accumulate(self, last: bool):
        # reduce-scatter gradients once per optimizer step, not after every micro-batch
        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _clip(self, max_norm: float | None) -> float:
        """The norm of sharded gradients is a DTensor: take its full value (the same in every process)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @contextlib.contextmanager
    def _gather_for_generation(self):
        """All weights gathered once for the whole generation (token-by-token decoding would
        otherwise all-gather every layer for every token, and every process would have to
        decode in lockstep); sharded again afterwards."""
        units = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
            u.unshard()
        try:
            yield self.module
        finally:
            for u in units:
                u.reshard()
                u.set_reshard_after_forward(self.cfg.train.fsdp.reshard_after_forward, recurse=False)

    # ------------------------------------------------------------ checkpoints

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        if self.ref_model is not None:
            state["reference"] = get_model_state_dict(self.ref_model)
        return state

    def save_state(self, folder: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(folder / "dcp"))

    def save_state_async(self, folder: Path):
        """DCP's async save: shards staged to CPU now, written by a background thread that
        coordinates over a gloo group of its own (never the training group, which the next
        step is using). Returns the wait for this process's part (rank 0: and the metadata)."""
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        saving = dcp.async_save(self._state(), checkpoint_id=str(folder / "dcp"), process_group=self._save_group)
        return getattr(
            saving, "upload_completion", saving
        ).result  # a Future, or (zero-overhead staging) a response holding one

    def load_state(self, folder: Path) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        if self.ref_model is not None:
            set_model_state_dict(self.ref_model, state["reference"])

    def export(self, path: Path, tokenizer) -> None:
        """Gather the full weights into rank 0's CPU memory and write a plain HF folder."""
        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if comm.is_main():
            save_model(self.module, tokenizer, path, state_dict=full)
        comm.barrier()
