"""Per-token log-probs of completions under a model, without materialising what isn't needed."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """log softmax(logits)[tokens], computed a few rows at a time in fp32.

    logits: [B, C, V], tokens: [B, C] -> [B, C]. Doing it in chunks keeps the fp32
    full-vocabulary copy to `chunk` rows (49k vocab x C tokens each), not the whole batch.
    """
    out = []
    for start in range(0, logits.shape[0], chunk):
        lg = logits[start : start + chunk].float()
        picked = lg.gather(-1, tokens[start : start + chunk, :, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(lg, dim=-1))
    return torch.cat(out)


def completion_logprobs(model, input_ids, attention_mask, prompt_len: int, temperature: float = 1.0) -> torch.Tensor:
    """[B, C] log-probs of the completion tokens (positions >= prompt_len) under `model`.

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
    return selective_log_softmax(logits, input_ids[:, prompt_len:])
