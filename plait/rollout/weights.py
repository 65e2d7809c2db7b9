"""Moving the trainer's weights into a generation engine.

Three small pieces, shared by the colocated engine (same process) and the server mode (other
processes, other machines):

- `full_weights(model)`: the policy's weights under the names of the Hugging Face checkpoint the
  engine loaded (a LoRA adapter merged in, tied copies once), which is what vLLM's
  `load_weights` expects.
- `plan_buckets`: group tensors into a few large flat buffers of one dtype, so a sync is a
  handful of broadcasts instead of one per parameter (a 135M model has ~270 tensors).
- `weight_group` / `send_buckets` / `receive_buckets`: a torch.distributed process group of its
  own (gloo on CPU, NCCL on GPU) between trainer rank 0 and every generation worker, created
  from a TCP store without touching the trainer's default group.
- `SharedWeights`: for the HF generation process on the trainer's own machine, a file in
  /dev/shm both map instead: one copy in, one copy out, no socket in between.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def _peft_name(name: str) -> str | None:
    """The base-model name of a merged PeftModel parameter, or None for adapter weights."""
    if "lora_" in name or "modules_to_save" in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _lora_deltas(model) -> dict[str, torch.Tensor]:
    """state_dict name of each LoRA-wrapped base weight -> the active adapters' delta (B @ A x
    scale). Added out of place: merging into the base and unmerging again would not restore
    it bit for bit, and the frozen base would drift a little every step."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            active = [a for a in m.active_adapters if a in m.lora_A]
            if active:
                deltas[f"{name}.base_layer.weight"] = sum(m.get_delta_weight(a) for a in active)
    return deltas


@contextlib.contextmanager
def full_weights(model) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(checkpoint name, tensor) for every weight `model` generates with, valid inside the block.

    A LoRA adapter is merged in (under the base model's names); tied weights (lm_head =
    embeddings) are listed once: the engine ties them itself.
    """
    peft = hasattr(model, "peft_config")
    with torch.no_grad():
        deltas = _lora_deltas(model) if peft else {}
        seen: set[int] = set()
        out = []
        for name, p in model.state_dict(keep_vars=True).items():
            if id(p) in seen:
                continue
            seen.add(id(p))
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            if name in deltas:
                t = t + deltas[name].to(t.dtype)
            if peft:
                name = _peft_name(name)
                if name is None:
                    continue
            out.append((name, t))
        yield out


# the parts of one adapted layer an adapter push sends, after the base weight's checkpoint name
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_scaling")


def adapter_part(name: str) -> tuple[str, str] | None:
    """(base weight name, part) of an adapter push's tensor name, or None for a plain weight."""
    base, _, part = name.rpartition(":")
    return (base, part) if base and part in ADAPTER_PARTS else None


def pushes_adapters(model) -> bool:
    """Can the engine get this model as its LoRA adapter alone? A peft model with one active
    LoRA adapter, plain (no DoRA, no fan_in_fan_out), whose every trained weight is in it
    (no modules_to_save): everything else is the base the engine loaded."""
    config = getattr(model, "peft_config", None)
    if not config or len(config) != 1:
        return False
    (c,) = config.values()
    if getattr(c, "use_dora", False) or getattr(c, "fan_in_fan_out", False) or getattr(c, "modules_to_save", None):
        return False
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    return bool(trained) and all(".lora_A." in n or ".lora_B." in n for n in trained)


def lora_rank(model) -> int:
    """The largest rank among a peft model's LoRA layers (its r, or a rank_pattern's)."""
    (c,) = model.peft_config.values()
    return max([c.r, *(c.rank_pattern or {}).values()])


@contextlib.contextmanager
def adapter_weights(model) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The LoRA adapter alone (pushes_adapters must hold): for each adapted layer, its A and B
    (in the trainer's dtype) and its scale, named `<base weight's checkpoint name>:<part>`. The
    engine adds (B @ A) x scale to its own copy of the base, as peft's get_delta_weight does, so
    it holds what full_weights would have sent."""
    from peft.tuners.lora import LoraLayer

    out = []
    with torch.no_grad():
        for name, m in model.named_modules():
            if not isinstance(m, LoraLayer):
                continue
            for a in (a for a in m.active_adapters if a in m.lora_A):
                base = _peft_name(f"{name}.base_layer.weight")
                A, B = (w.detach() for w in (m.lora_A[a].weight, m.lora_B[a].weight))
                A, B = (w.full_tensor() if hasattr(w, "full_tensor") else w for w in (A, B))
                out += [(f"{base}:lora_A", A), (f"{base}:lora_B", B)]
                out.append((f"{base}:lora_scaling", torch.tensor([float(m.scaling[a])], dtype=torch.float64)))
        yield out


def apply_adapter(base: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """base + (B @ A) x scale, in the adapter's dtype (peft's get_delta_weight for a Linear),
    cast to the base's dtype."""
    delta = (parts["lora_B"] @ parts["lora_A"]) * float(parts["lora_scaling"])
    return (base.to(delta.dtype) + delta).to(base.dtype)


def write_lora_adapter(weights: list[tuple[str, torch.Tensor]], folder: str | os.PathLike) -> int:
    """An adapter push (`adapter_weights`' tensors, or the same received) as the peft adapter
    folder vLLM loads through a LoRARequest; returns the bytes written. Each layer's scale is
    folded into its B (as vLLM itself does when it loads one) and its alpha is its rank, so vLLM
    (and peft) scale by exactly 1 whatever scales the layers had."""
    from safetensors.torch import save_file

    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        base, part = adapter_part(name) or (None, None)
        if base is None:
            raise ValueError(f"{name} is not part of a LoRA adapter push")
        layers.setdefault(base.removesuffix(".weight"), {})[part] = t
    tensors, ranks = {}, {}
    for module, parts in layers.items():
        A, B = parts["lora_A"], parts["lora_B"]
        scaled = (B * float(parts["lora_scaling"])).to(B.dtype)
        tensors[f"base_model.model.{module}.lora_A.weight"] = A.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = scaled.contiguous()
        ranks[module] = A.shape[0]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    r = max(ranks.values())
    other = {m: k for m, k in ranks.items() if k != r}  # layers of another rank: alpha = their rank too
    config = dict(
        peft_type="LORA",
        r=r,
        lora_alpha=r,
        rank_pattern=other,
        alpha_pattern=other,
        target_modules=sorted({m.rpartition(".")[2] for m in layers}),
        bias="none",
        use_rslora=False,
        use_dora=False,
    )
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices of `metas` grouped into buckets of one dtype and at most `bucket_bytes` each
    (a tensor larger than that gets a bucket of its own). Order within a dtype is kept."""
    buckets: list[list[int]] = []
    open_bucket: dict[str, tuple[list[int], int]] = {}
    for i, m in enumerate(metas):
        idx, size = open_bucket.get(m.dtype, ([], 0))
        if idx and size + m.nbytes > bucket_bytes:
            buckets.append(idx)
            idx, size = [], 0
        open_bucket[m.dtype] = (idx + [i], size + m.nbytes)
    buckets += [idx for idx, _ in open_bucket.values() if idx]
    return buckets


def weight_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float):
    """A process group of its own (rank 0 = the trainer, which hosts the TCP store). Every
    collective on it fails after `timeout_s` instead of hanging when a peer is gone."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore("plait-weights", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def send_buckets(group, tensors: list[torch.Tensor], buckets: list[list[int]], device) -> None:
    """Broadcast each bucket as one flat buffer from rank 0 (the trainer)."""
    for idx in buckets:
        flat = torch.cat([tensors[i].reshape(-1).to(device) for i in idx])
        _broadcast(group, flat)


def receive_buckets(
    group, metas: list[TensorMeta], buckets: list[list[int]], device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The receiving side of `send_buckets`: yields each bucket's (name, tensor) views."""
    for idx in buckets:
        dtype = getattr(torch, metas[idx[0]].dtype)
        flat = torch.empty(sum(metas[i].numel for i in idx), dtype=dtype, device=device)
        _broadcast(group, flat)
        out, offset = [], 0
        for i in idx:
            m = metas[i]
            out.append((m.name, flat[offset : offset + m.numel].view(m.shape)))
            offset += m.numel
        yield out


def metas_of(weights: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights]


SHARED_ALIGN = 64  # bytes: every tensor in a shared file starts at a multiple (any dtype can view it)


def shared_layout(metas: list[TensorMeta]) -> tuple[list[int], int]:
    """(byte offset of each tensor, bytes in all) in a SharedWeights file: back to back, aligned."""
    offsets, end = [], 0
    for m in metas:
        end = -(-end // SHARED_ALIGN) * SHARED_ALIGN
        offsets.append(end)
        end += m.nbytes
    return offsets, end


class SharedWeights:
    """A file in /dev/shm (memory, not disk) that the trainer and the generation process it
    started both map: a push copies the tensors in, the generation process copies them into its
    model; the HTTP request that announces a push carries their names, dtypes and shapes, and
    both sides find them at the same offsets (`shared_layout`). Each side keeps its mapping
    between pushes (mapping anew would fault every page in again). The writer sizes the file
    itself: torch.from_file, asked for more than a file holds, grows it but zeroes its first byte."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.buf: torch.Tensor | None = None

    def _mapped(self, nbytes: int, writer: bool) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            if writer and (not self.path.exists() or self.path.stat().st_size < nbytes):
                # readable by this user alone: the weights are the run's, /dev/shm is everyone's
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                finally:
                    os.close(fd)
            size = self.path.stat().st_size
            if size < nbytes:
                raise ValueError(f"{self.path} holds {size} bytes, fewer than the {nbytes} this push needs")
            self.buf = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        return self.buf

    def views(self, metas: list[TensorMeta], writer: bool = False) -> list[torch.Tensor]:
        """Each tensor of `metas` as a view of the mapped file."""
        offsets, total = shared_layout(metas)
        buf = self._mapped(total, writer)
        return [buf[o : o + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape) for o, m in zip(offsets, metas)]

    def write(self, weights: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
        """The trainer's side: copy `weights` in; returns what the reader needs to find them."""
        metas = metas_of(weights)
        for view, (_, t) in zip(self.views(metas, writer=True), weights):
            view.copy_(t)
        return metas

    def close(self) -> None:
        """Unmap and remove the file (its memory is freed once the other side has unmapped it too)."""
        self.buf = None
        self.path.unlink(missing_ok=True)
