"""What a round computed, stage by stage, as short hashes (RUN_DIR/hashes.jsonl): two runs that
agree on every hash of a round computed the same bits, and the first hash that differs names the
stage where they part (`plait diff`).

    generation  prompt and completion token ids, and the engine's log-probs of them
    scoring     every reward function's scores
    advantages  the advantages the loss used
    loss        the gradient of the round's first update (forward, loss and backward; train.deterministic)
    optimizer   the weights after the round's updates (train.deterministic)

Each process hashes its own share (its rows; its shard of sharded weights); the record holds
one hash over the processes' hashes in rank order, so these depend on the number of processes.

One more record, `completions`, does not: every group's prompt and completion token ids, hashed
per group and taken in order of their hashes across all processes. Two runs that sampled the
same completions agree on it whatever their process counts or batch layouts (the generation
stage also hashes the padding and the engine's log-probs, which do not agree across those).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from plait import comm
from plait.types import Batch, Group


STAGES = ("generation", "scoring", "advantages", "loss", "optimizer")
DIGITS = 16  # hex digits kept: 64 bits, ample to tell two runs apart


def digest(arrays) -> str:
    """sha256 over the raw bytes of tensors and arrays (shape and dtype included)."""
    h = hashlib.sha256()
    for a in arrays:
        kind = None
        if isinstance(a, torch.Tensor):
            a = a.detach().cpu().contiguous()
            kind = str(a.dtype)
            if a.dtype == torch.bfloat16:  # numpy has no bf16: its bits as int16, named as bf16
                a = a.view(torch.int16)
            a = a.numpy()
        a = np.ascontiguousarray(a)
        h.update(f"{kind or a.dtype}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:DIGITS]


def generation_hash(batch: Batch) -> str:
    return digest([batch.input_ids, batch.attention_mask, batch.completion_mask, batch.sampling_logprobs])


def group_hash(group: Group) -> str:
    """A group's prompt (dataset index and token ids) and its completions' token ids, in order."""
    ids = [np.asarray(c.token_ids, dtype=np.int64) for c in group.completions]
    return digest(
        [np.array([group.prompt.index], dtype=np.int64), np.asarray(group.prompt.token_ids, dtype=np.int64), *ids]
    )


def scoring_hash(groups: list[Group]) -> str:
    names = sorted(groups[0].rewards) if groups else []
    scores = [
        np.array([math.nan if v is None else v for g in groups for v in g.rewards[n]], dtype=np.float64) for n in names
    ]
    return digest([np.array(names, dtype=str), *scores])


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's shard, a ZeRO-3 parameter's partition."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def weights_hash(module: torch.nn.Module) -> str:
    return digest(_local(p) for _, p in sorted(module.named_parameters()))


def gradient_hash(module: torch.nn.Module) -> str | None:
    """The gradients this process holds (None where the backend keeps them out of `.grad`: DeepSpeed)."""
    grads = [_local(p.grad) for _, p in sorted(module.named_parameters()) if p.grad is not None]
    return digest(grads) if grads else None


def gather_hashes(local: RoundHashes) -> dict[str, str | None]:
    """One hash per stage over every process's (in rank order), and the `completions` record
    over every process's groups; collective."""
    every = comm.all_gather_objects((dict(local), local.groups))
    stages = dict(local)
    if len(every) > 1:
        stages = {
            k: None if any(h[k] is None for h, _ in every) else digest_text([h[k] for h, _ in every]) for k in local
        }
    return {**stages, "completions": completions_record([groups for _, groups in every])}


def completions_record(per_process: list[list[str]]) -> str:
    """One hash over every process's group hashes, whichever process holds which group."""
    return digest_text(sorted(g for groups in per_process for g in groups))


def digest_text(parts: list[str]) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:DIGITS]


class RoundHashes(dict):
    """A round's hashes by stage, added as the round computes them, and its groups' hashes."""

    def __init__(self, *args, groups: list[str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = groups or []

    def add_gradient(self, module: torch.nn.Module) -> None:
        self["loss"] = gradient_hash(module)

    def add_weights(self, module: torch.nn.Module) -> None:
        self["optimizer"] = weights_hash(module)


def rollout_hashes(groups: list[Group], batch: Batch) -> RoundHashes:
    """Generation, scoring and advantages (cheap: every run records them)."""
    return RoundHashes(
        generation=generation_hash(batch),
        scoring=scoring_hash(groups),
        advantages=digest([batch.advantages]),
        groups=[group_hash(g) for g in groups],
    )
