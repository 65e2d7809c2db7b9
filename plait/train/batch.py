"""Groups -> padded training tensors, and micro-batches cut to their own lengths."""

from __future__ import annotations

import torch

from plait.rollout.hf import left_pad
from plait.types import Batch, Group


def collate(groups: list[Group], pad_id: int, mask_truncated: bool = False) -> Batch:
    """One row per completion: [left-padded prompt | right-padded completion].

    Advantages start at zero; the loop fills them in. With `mask_truncated`, completions cut at
    max_completion_length keep their row but contribute no tokens to the loss. Tokens the model
    did not sample (a tool's output in a multi-turn completion) are context only: masked out.
    """
    prompts, completions, truncated, sampling, sampled = [], [], [], [], []
    for g in groups:
        for c in g.completions:
            prompts.append(g.prompt.token_ids if c.prompt_ids is None else c.prompt_ids)
            completions.append(c.token_ids)
            truncated.append(c.truncated)
            sampling.append(c.logprobs)
            sampled.append(c.sampled_mask)
    p_ids, p_mask = left_pad(prompts, pad_id)
    width = max(1, max(len(c) for c in completions))
    c_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(completions), width), dtype=torch.long)
    s_lp = torch.zeros((len(completions), width), dtype=torch.float32)
    for i, (c, lp) in enumerate(zip(completions, sampling)):
        c_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, : len(c)] = 1
        s_lp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    loss_mask = c_mask.clone()
    for i, m in enumerate(sampled):
        if m is not None:
            loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    if mask_truncated:
        loss_mask[torch.tensor(truncated, dtype=torch.bool)] = 0
    return Batch(
        input_ids=torch.cat([p_ids, c_ids], 1),
        attention_mask=torch.cat([p_mask, c_mask], 1),
        completion_mask=loss_mask,
        advantages=torch.zeros(len(completions)),
        prompt_len=p_ids.shape[1],
        sampling_logprobs=s_lp,
    )


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive slices of `size` rows, each trimmed of all-padding columns on both ends,
    so a micro-batch of short sequences costs only its own length."""
    out = []
    for start in range(0, len(batch), size):
        mb = batch.slice(start, start + size)
        used = mb.attention_mask.any(0)
        prompt_used, completion_used = used[: mb.prompt_len], used[mb.prompt_len :]
        first_prompt = int(prompt_used.float().argmax()) if prompt_used.any() else mb.prompt_len
        last = mb.prompt_len + (int(completion_used.nonzero().max()) + 1 if completion_used.any() else 1)
        out.append(_cut(mb, first_prompt, last))
    return out


def _cut(mb: Batch, first: int, last: int) -> Batch:
    """Keep columns [first, last) of the sequence (completion tensors: [.., last - prompt_len))."""
    c_end = last - mb.prompt_len
    return mb.map(
        lambda t: t[:, first:last],
        completion=lambda t: t[:, :c_end],
        row=lambda t: t if t.dim() == 1 else t[:, :c_end],  # token-level advantages run along the completion
        prompt_len=mb.prompt_len - first,
    )
