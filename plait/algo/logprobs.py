"""Per-token log-probs (and entropies) of completions, without materialising what isn't needed."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 8, with_entropy: bool = False):
    """log softmax(logits)[tokens] (and the entropy of each position), a few rows at a time in fp32.

    logits: [B, C, V], tokens: [B, C] -> [B, C] (or a pair). Chunking keeps the fp32
    full-vocabulary copy to `chunk` rows instead of the whole batch.
    """
    logps, ents = [], []
    for start in range(0, logits.shape[0], chunk):
        lg = logits[start : start + chunk].float()
        lse = torch.logsumexp(lg, dim=-1)
        logps.append(lg.gather(-1, tokens[start : start + chunk, :, None]).squeeze(-1) - lse)
        if with_entropy:  # H = logsumexp - sum p * logit
            ents.append(lse - (torch.softmax(lg, -1) * lg).sum(-1))
    if with_entropy:
        return torch.cat(logps), torch.cat(ents)
    return torch.cat(logps)


def completion_logprobs(model, input_ids, attention_mask, prompt_len: int, temperature: float = 1.0, with_entropy: bool = False):
    """[B, C] log-probs of the completion tokens (positions >= prompt_len) under `model`
    (and their entropies when asked).

    Only the last C+1 positions go through the LM head (`logits_to_keep`), so prompt
    positions never produce vocabulary-sized logits. Logits are divided by the sampling
    temperature so the numbers match the distribution the completions were drawn from.
    """
    completion_len = input_ids.shape[1] - prompt_len
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=completion_len + 1,
    )
    logits = out.logits[:, :-1]
    if temperature and temperature != 1.0:
        logits = logits / temperature
    return selective_log_softmax(logits, input_ids[:, prompt_len:], with_entropy=with_entropy)


def prompt_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> list[int]:
    """Lengths of the runs of consecutive rows that share the same (padded) prompt: a group's
    completions sit next to each other, so a micro-batch of G whole groups gives G runs."""
    runs: list[int] = []
    for i in range(input_ids.shape[0]):
        same = i > 0 and torch.equal(input_ids[i, :prompt_len], input_ids[i - 1, :prompt_len]) and torch.equal(
            attention_mask[i, :prompt_len], attention_mask[i - 1, :prompt_len])
        if same:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def shared_prompt_logprobs(model, input_ids, attention_mask, prompt_len: int, runs: list[int], temperature: float = 1.0,
                           with_entropy: bool = False):
    """completion_logprobs, with each distinct prompt run through the model once: its KV cache
    is handed to the rows that share it (gradients flow back through the shared cache into
    the one prompt pass). A group of n completions then costs one prompt + n completions
    instead of n prompts + n completions, in the forward and the backward alike."""
    from transformers import DynamicCache

    first = torch.tensor([sum(runs[:g]) for g in range(len(runs))], device=input_ids.device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    head = model(input_ids=input_ids[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                 position_ids=positions[first, :prompt_len], past_key_values=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:  # every row gets its prompt's keys/values
        layer.keys, layer.values = _spread(layer.keys, runs), _spread(layer.values, runs)
    completion = input_ids[:, prompt_len:]
    tail = model(input_ids=completion, attention_mask=attention_mask, position_ids=positions[:, prompt_len:],
                 past_key_values=cache, use_cache=True, logits_to_keep=completion.shape[1])
    logits = torch.cat([_spread(head.logits, runs), tail.logits[:, :-1]], dim=1)  # position t predicts token t+1
    if temperature and temperature != 1.0:
        logits = logits / temperature
    return selective_log_softmax(logits, completion, with_entropy=with_entropy)


def _spread(t: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """Row g of `t` repeated runs[g] times. expand + cat, not an index gather: its backward is
    a plain sum per group, so gradients add up in the same order every run (an index_add
    backward may not), and resumed runs stay bitwise identical."""
    return torch.cat([t[g : g + 1].expand(n, *t.shape[1:]) for g, n in enumerate(runs)])
