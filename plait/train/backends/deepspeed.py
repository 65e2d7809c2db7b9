"""DeepSpeed ZeRO stage 2 (gradients and optimizer state sharded) or stage 3 (parameters
too), through DeepSpeed's own engine. With stage 3 the model is built under
`deepspeed.zero.Init` (transformers does this when an `HfDeepSpeedConfig` is alive), so each
weight is partitioned as it loads: no process ever holds the full fp32 model. Checkpoints
are DeepSpeed's own (each process writes its partition).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from plait import comm
from plait.models import save_model
from plait.train.backends.base import StepOutcome
from plait.train.backends.local import LocalBackend, held_teacher
from plait.train.optim import make_optimizer


def deepspeed_config(cfg, world_size: int) -> dict:
    """The DeepSpeed JSON for this run: batch sizes from plait's batch arithmetic, ZeRO
    options from train.deepspeed, then the user's `extra` keys merged on top."""
    t, ds = cfg.train, cfg.train.deepspeed
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * world_size,
        "zero_optimization": zero,
        # plait's own AdamW (torch), so no CUDA op has to be built
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": t.max_grad_norm or 0.0,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return _merge(out, ds.extra)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class DeepSpeedBackend(LocalBackend):
    name = "deepspeed"
    shares_prompt_pass = False  # the engine hooks one forward to one backward
    async_save = False  # DeepSpeed writes its ZeRO partitions itself, synchronously

    def load(self, cfg) -> None:
        import deepspeed

        from plait.models import load_model

        if comm.world_size() == 1:  # started without torchrun: DeepSpeed still reads these
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)
        if not torch.cuda.is_available():
            # the CPU accelerator compiles a shared-memory all-reduce (deepspeed_shm_comm) when its
            # process group starts: 30-75 s of a 2-core CPU the first time (and again for each
            # install), for DeepSpeed's inference kernels; ZeRO's collectives go through
            # torch.distributed and never call it
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # adopts plait's process group
        self.stage = cfg.train.deepspeed.zero_stage
        self.ds_config = deepspeed_config(cfg, comm.world_size())
        self._hf_ds = None
        if self.stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            # while this object lives, from_pretrained partitions every weight as it loads
            self._hf_ds = HfDeepSpeedConfig(self.ds_config)
        m = cfg.model
        module = load_model(m.name_or_path, m.dtype, None, m.gradient_checkpointing)
        self._skeleton_config = module.config
        # the LR schedule steps the client optimizer's param groups, which ZeRO keeps using
        optimizer, self.scheduler = make_optimizer(module, cfg, fused=False)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=self.ds_config
        )
        self.module = self.model.module
        self.module.train()
        if cfg.algo.beta > 0:
            self.ref_model = self._frozen(load_model(m.name_or_path, m.dtype))
        if held_teacher(cfg):
            self.teacher_model = self._frozen(load_model(cfg.teacher.name_or_path, cfg.teacher.dtype or m.dtype))

    def _frozen(self, model):
        """A model that only runs forward (reference, teacher), held as this ZeRO stage holds weights."""
        import deepspeed

        model.eval().requires_grad_(False)
        if self.stage == 3:  # a ZeRO-3 engine without optimizer: sharded, forward only (placed by DeepSpeed)
            frozen_cfg = {k: v for k, v in self.ds_config.items() if k != "gradient_clipping"}
            return deepspeed.initialize(model=model, config=frozen_cfg)[0].module.eval()
        return model.to(self.device)  # ZeRO-2 shards no parameter: a plain frozen copy in every process

    def describe(self) -> dict:
        local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in self.module.parameters())
        total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.module.parameters())
        return {"backend": self.name, "zero_stage": self.stage, "params_local": local, "params_total": total}

    def keep_casts(self):
        # ZeRO-3 gathers each weight anew for every forward: a kept cast would hold the gathered one
        return contextlib.nullcontext()

    def accumulate(self, last: bool):
        # plait says where an update ends (its micro-batch count per update may differ from
        # the JSON's gradient_accumulation_steps); gradients are reduced at that boundary
        self.model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # the loss is normalized over the whole update already: no division by accumulation
        # steps, and x world size because DeepSpeed averages gradients over processes
        self.model.backward(loss * comm.world_size(), scale_wrt_gas=False)

    def step(self, max_norm: float | None) -> StepOutcome:
        # DeepSpeed clips by its config (gradient_clipping = max_norm), and ZeRO skips an
        # update whose gradients hold inf/NaN (checked over all processes)
        lr = self.scheduler.get_last_lr()[0]
        self.model.step()  # clip, update, zero the gradients
        if not self.model.was_step_applied():
            return StepOutcome(False, float("inf"), lr)
        norm = self.model.get_global_grad_norm()
        return StepOutcome(True, float(norm) if norm is not None else 0.0, lr, self._after_update())

    @contextlib.contextmanager
    def _gather_for_generation(self):
        """Stage 2 samples from the training module. Stage 3 gathers each weight into a
        temporary full copy (freed after generation): decoding from partitioned weights
        would all-gather every layer for every token, in lockstep across processes."""
        if self.stage != 3:
            yield self.module
            return
        from transformers import AutoModelForCausalLM

        with torch.device("meta"), _zero3_off():
            replica = AutoModelForCausalLM.from_config(self._skeleton_config)
        replica.to_empty(device=self.device)
        with torch.no_grad():
            for name, full in self._gathered_weights():
                replica.get_parameter(name).copy_(full)
            for name, b in self.module.named_buffers():  # ZeRO never partitions buffers
                replica.get_buffer(name).copy_(b)
        replica.tie_weights()  # to_empty gave tied weights separate storage: tie them again
        replica.generation_config = self.module.generation_config
        try:
            yield replica
        finally:
            del replica

    def _gathered_weights(self):
        """(name, full weight) for every ZeRO-3 parameter, one gathered at a time (a
        collective: every process must iterate to the end)."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        for name, p in self.module.named_parameters():
            with GatheredParameters([p], modifier_rank=None):
                yield name, p

    # ------------------------------------------------------------ checkpoints

    def save_state(self, folder: Path) -> None:
        self.model.save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)

    def load_state(self, folder: Path) -> None:
        self.model.load_checkpoint(str(folder / "deepspeed"), tag="state", load_lr_scheduler_states=False)

    def export(self, path: Path, tokenizer) -> None:
        """Gather the weights one by one into rank 0's CPU memory; write a plain HF folder."""
        if self.stage == 3:
            full = {name: t.detach().cpu().clone() for name, t in self._gathered_weights() if comm.is_main()}
            persistent = set(self.module.state_dict())
            full.update({n: b.detach().cpu().clone() for n, b in self.module.named_buffers() if n in persistent})
        else:
            full = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        if comm.is_main():
            with _zero3_off():
                save_model(self.module, tokenizer, path, state_dict=full)
        comm.barrier()


@contextlib.contextmanager
def _zero3_off():
    """Build or save a plain model while the ZeRO-3 config is alive (transformers would
    otherwise partition it too)."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved
