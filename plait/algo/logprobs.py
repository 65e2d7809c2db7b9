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
