"""Per-token log-probs (and entropies) of completions, without materialising what isn't needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.models import text_config


def _logps(lg: torch.Tensor, tokens: torch.Tensor, with_entropy: bool | str, top_k: int = 0):
    """log softmax(lg)[tokens] of [..., V] logits in fp32 (and H = logsumexp - sum p * logit;
    with_entropy="logged": H without a gradient, so nothing vocabulary-sized is kept for backward;
    or with top_k, the k likeliest tokens' ids and log-probs). tokens: [...] (one token a
    position) or [..., m] (m tokens a position)."""
    lg = lg.float()
    lse = torch.logsumexp(lg, dim=-1)
    if tokens.dim() == lg.dim():
        logp = lg.gather(-1, tokens) - lse[..., None]
    else:
        logp = lg.gather(-1, tokens[..., None]).squeeze(-1) - lse
    if top_k:
        top = lg.topk(top_k, dim=-1)
        return logp, top.indices, top.values - lse[..., None]
    if not with_entropy:
        return logp
    if with_entropy == "logged":
        lse, lg = lse.detach(), lg.detach()
    return logp, lse - (torch.softmax(lg, -1) * lg).sum(-1)


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits divided by the sampling temperature (unchanged for 0 or 1), so log-probs match
    the distribution the completions were drawn from."""
    if temperature and temperature != 1.0:
        return logits / temperature
    return logits


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def selective_log_softmax(
    logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 8, with_entropy: bool | str = False, top_k: int = 0
):
    """log softmax(logits)[tokens] (and the entropy of each position: with_entropy True, or
    "logged" for one without a gradient; or with top_k, the ids and log-probs of the k likeliest
    tokens at each position, likeliest first), `chunk` rows of the first dimension at a time in fp32.

    logits: [B, C, V] or [N, V], tokens: [B, C] or [N] -> that shape (or a pair, or a triple with
    two [..., k]); tokens [B, C, m] or [N, m] (m tokens a position) -> that shape, the entropy one
    per position. Chunking keeps the fp32 full-vocabulary copy to `chunk` rows instead of the
    whole batch.
    """
    parts = [_logps(lg, tk, with_entropy, top_k) for lg, tk in zip(logits.split(chunk), tokens.split(chunk))]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def with_extra(targets: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The tokens whose log-probs are read at each position: the targets [...], or with `extra`
    [..., k] token ids, [..., 1 + k]: the target first, then those."""
    return targets if extra is None else torch.cat([targets[..., None], extra], -1)


def completion_logprobs(
    model,
    input_ids,
    attention_mask,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool | str = False,
    extra: torch.Tensor | None = None,
    top_k: int = 0,
):
    """[B, C] log-probs of the completion tokens (positions >= prompt_len) under `model`
    (and their entropies when asked); with `extra` [B, C, k] token ids, [B, C, 1 + k]: the
    completion token's, then those of the extra tokens at each position; with `top_k`, also the
    ids and log-probs of the model's k likeliest tokens at each position ([B, C, k] each).

    Only the last C+1 positions go through the LM head (`logits_to_keep`), so prompt
    positions never produce vocabulary-sized logits. Logits are divided by the sampling
    temperature so the numbers match the distribution the completions were drawn from.
    """
    completion_len = input_ids.shape[1] - prompt_len
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions(attention_mask),
        use_cache=False,
        logits_to_keep=completion_len + 1,
    )
    logits = scale_logits(out.logits[:, :-1], temperature)
    tokens = with_extra(input_ids[:, prompt_len:], extra)
    return selective_log_softmax(logits, tokens, with_entropy=with_entropy, top_k=top_k)


def prompt_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> list[int]:
    """Lengths of the runs of consecutive rows that share the same (padded) prompt: a group's
    completions sit next to each other, so a micro-batch of G whole groups gives G runs."""
    runs: list[int] = []
    for i in range(input_ids.shape[0]):
        same = (
            i > 0
            and torch.equal(input_ids[i, :prompt_len], input_ids[i - 1, :prompt_len])
            and torch.equal(attention_mask[i, :prompt_len], attention_mask[i - 1, :prompt_len])
        )
        if same:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def shared_prompt_logprobs(
    model,
    input_ids,
    attention_mask,
    prompt_len: int,
    runs: list[int],
    temperature: float = 1.0,
    with_entropy: bool | str = False,
    extra: torch.Tensor | None = None,
    top_k: int = 0,
):
    """completion_logprobs, with each distinct prompt run through the model once: its KV cache
    is handed to the rows that share it (gradients flow back through the shared cache into
    the one prompt pass). A group of n completions then costs one prompt + n completions
    instead of n prompts + n completions, in the forward and the backward alike.

    The prompt pass stops one token short and makes no logits: each row feeds the prompt's
    last token itself (left padding puts a real token there), so every prediction comes out
    of one pass through the output head, and the head's weight gradient is one product
    instead of two added up (for a 49k-token vocabulary that second one is 113 MB a pass)."""
    from transformers import DynamicCache

    first = torch.tensor([sum(runs[:g]) for g in range(len(runs))], device=input_ids.device)
    pos = positions(attention_mask)
    cache, cut = DynamicCache(), prompt_len - 1
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    model(
        input_ids=input_ids[first, :cut],
        attention_mask=attention_mask[first, :cut],
        position_ids=pos[first, :cut],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=no_logits,
    )
    for layer in cache.layers:  # every row gets its prompt's keys/values
        layer.keys, layer.values = _spread(layer.keys, runs), _spread(layer.values, runs)
    completion_len = input_ids.shape[1] - prompt_len
    predicting = torch.arange(completion_len, device=input_ids.device)  # the last token predicts nothing
    logits = model(
        input_ids=input_ids[:, cut:],
        attention_mask=attention_mask,
        position_ids=pos[:, cut:],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=predicting,
    ).logits
    logits = scale_logits(logits, temperature)
    tokens = with_extra(input_ids[:, prompt_len:], extra)
    return selective_log_softmax(logits, tokens, with_entropy=with_entropy, top_k=top_k)


@dataclass
class PackedGroups:
    """A micro-batch laid out as packed rows: a row's prompt tokens, then each completion after
    them, no padding between them. A row holds one group, or every group when their prompts
    share a long beginning (a system prompt, worked examples): that beginning once, then each
    group's own rest of the prompt and its completions. `allowed` lets a token see what it
    would see in its own padded row only (its prompt, its own past), so every token computes
    what it would there."""

    input_ids: torch.Tensor  # [R, S]
    position_ids: torch.Tensor  # [R, S]: a completion's positions continue from its prompt's
    allowed: torch.Tensor  # [R, 1, S, S] bool: query may attend to key
    source: torch.Tensor  # [N] flat index into R*S: the position whose logits predict each completion token
    targets: torch.Tensor  # [N] the completion tokens
    rows: torch.Tensor  # [N] where each token sits in the [B, C] output
    cols: torch.Tensor  # [N]


def common_prefix(prompts: list[list[int]]) -> int:
    """How many first tokens every prompt shares, leaving each at least its last token of its own
    (the position that predicts its first completion token)."""
    limit = min(len(p) for p in prompts) - 1
    for i in range(limit):
        if any(p[i] != prompts[0][i] for p in prompts[1:]):
            return i
    return max(0, limit)


def _one_row_costs_less(prompts, completions, shared: int, hidden_size: int | None) -> bool:
    """Whether one row holding the shared beginning once beats a row per group. Both are
    costed as a token's matmuls (~24 x hidden^2 FLOPs a layer) plus the attention's scores, which
    sdpa computes for every (query, key) pair of a row under a mask (~4 x hidden FLOPs each): a
    score is 1/(6 x hidden) of a token."""
    if hidden_size is None or shared == 0 or len(prompts) < 2:
        return False
    lengths = [len(p) + sum(len(c) for c in cs) for p, cs in zip(prompts, completions)]
    per_group, width = len(lengths) * max(lengths), sum(lengths) - shared * (len(lengths) - 1)
    per_score = 1.0 / (6 * hidden_size)
    return width + width * width * per_score < per_group + per_group * max(lengths) * per_score


def pack_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    runs: list[int],
    hidden_size: int | None = None,
) -> PackedGroups:
    """Lay a micro-batch of whole groups (rows [B, prompt_len + C]: left-padded prompts,
    right-padded completions; `runs` rows per group) out as packed rows: one row per group, or,
    given the model's `hidden_size`, one row for all when their prompts' shared beginning makes
    that cheaper. Rows shorter than the longest are filled with token 0, which only padding
    attends to."""
    ids, mask = input_ids.tolist(), attention_mask.tolist()
    prompts, completions, first_rows = [], [], []
    start = 0
    for n in runs:
        prompt = [t for t, m in zip(ids[start][:prompt_len], mask[start][:prompt_len]) if m]
        if not prompt:
            raise ValueError(
                f"row {start} has an empty prompt: a completion needs at least one prompt token to be predicted from"
            )
        prompts.append(prompt)
        completions.append(
            [[t for t, m in zip(ids[r][prompt_len:], mask[r][prompt_len:]) if m] for r in range(start, start + n)]
        )
        first_rows.append(start)
        start += n
    shared = common_prefix(prompts)
    if _one_row_costs_less(prompts, completions, shared, hidden_size):
        layout = [(prompts[0][:shared], list(range(len(prompts))))]
    else:
        layout = [(p, [g]) for g, p in enumerate(prompts)]
    # per position: its group (-1: the row's shared beginning, -2: padding) and its part of the
    # group (0: the prompt, i + 1: completion i, -1: padding)
    seqs, groups, parts, poss, source, targets, rows, cols = [], [], [], [], [], [], [], []
    for r, (head, members) in enumerate(layout):
        seq, grp, part, pos = list(head), [-1] * len(head), [0] * len(head), list(range(len(head)))
        for g in members:
            rest = prompts[g][len(head) :]
            seq += rest
            grp += [g] * len(rest)
            part += [0] * len(rest)
            pos += range(len(head), len(prompts[g]))
            last = len(seq) - 1  # the prompt's last token predicts the first completion token
            for i, completion in enumerate(completions[g]):
                prev = last
                for j, tok in enumerate(completion):
                    source.append((r, prev))
                    targets.append(tok)
                    rows.append(first_rows[g] + i)
                    cols.append(j)
                    prev = len(seq)
                    seq.append(tok)
                    grp.append(g)
                    part.append(i + 1)
                    pos.append(len(prompts[g]) + j)
        seqs.append(seq), groups.append(grp), parts.append(part), poss.append(pos)
    width = max(len(s) for s in seqs)
    dev = input_ids.device

    def pad(xs, v):
        return torch.tensor([x + [v] * (width - len(x)) for x in xs], dtype=torch.long, device=dev)

    grp, part = pad(groups, -2), pad(parts, -1)
    q_grp, k_grp, q_part, k_part = grp[:, :, None], grp[:, None, :], part[:, :, None], part[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    # padding sees only padding (so no row of the mask is empty)
    sees = ((k_grp == -1) & (q_grp != -2)) | ((k_grp == q_grp) & ((k_part == 0) | (k_part == q_part)))
    allowed = causal & sees
    flat = torch.tensor([r * width + p for r, p in source], dtype=torch.long, device=dev)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    return PackedGroups(
        pad(seqs, 0), pad(poss, 0), allowed[:, None], flat, as_tensor(targets), as_tensor(rows), as_tensor(cols)
    )


def can_pack(model) -> bool:
    """The packed pass runs the decoder and the output head separately: only for models whose
    logits are the head's plain projection of the last hidden state."""
    cfg = getattr(model, "config", None)
    scaled = any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale"))
    try:
        return not scaled and model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


def packed_group_logprobs(
    model,
    input_ids,
    attention_mask,
    prompt_len: int,
    runs: list[int],
    temperature: float = 1.0,
    with_entropy: bool | str = False,
    through_forward: bool = False,
    extra: torch.Tensor | None = None,
    top_k: int = 0,
):
    """completion_logprobs with each group packed into one row (pack_groups): a group's prompt
    goes through the model once and no padding goes through it at all, forward and backward;
    the output head runs only where a completion token is predicted. [B, C] out, zeros at
    padding (as the masked loss ignores them).

    through_forward: call the model's own forward (a DDP, FSDP2 or ZeRO wrapper, whose hooks
    pair one forward with one backward and gather sharded weights) rather than its decoder and
    output head apart; the head then also runs on the positions between the earliest predicting
    one and the row's end."""
    text = text_config(getattr(getattr(model, "module", model), "config", None))
    packed = pack_groups(input_ids, attention_mask, prompt_len, runs, getattr(text, "hidden_size", None))
    dtype = next(model.parameters()).dtype
    bias = torch.zeros(packed.allowed.shape, dtype=dtype, device=input_ids.device)
    bias = bias.masked_fill(~packed.allowed, torch.finfo(dtype).min)
    inputs = {"input_ids": packed.input_ids, "attention_mask": bias, "position_ids": packed.position_ids}
    if through_forward:
        logits = _packed_logits_by_forward(model, inputs, packed)
    else:
        hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[packed.source])
    logits = scale_logits(logits, temperature)
    tokens = with_extra(packed.targets, None if extra is None else extra[packed.rows, packed.cols])
    out = selective_log_softmax(logits, tokens, chunk=512, with_entropy=with_entropy, top_k=top_k)
    shape = (input_ids.shape[0], input_ids.shape[1] - prompt_len)

    def place(values: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(shape + values.shape[1:], dtype=values.dtype, device=values.device)
        return zeros.index_put((packed.rows, packed.cols), values)

    return tuple(place(o) for o in out) if isinstance(out, tuple) else place(out)


def _packed_logits_by_forward(model, inputs: dict, packed: PackedGroups) -> torch.Tensor:
    """[N, V] logits at the packed rows' predicting positions, from the model's forward with
    logits_to_keep = the positions from the earliest predicting one on."""
    width = packed.input_ids.shape[1]
    group, pos = packed.source // width, packed.source % width
    first = int(pos.min())
    keep = torch.arange(first, width, device=pos.device)
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits  # [G, width - first, V]
    return logits.reshape(-1, logits.shape[-1])[group * (width - first) + pos - first]


def _spread(t: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """Row g of `t` repeated runs[g] times. expand + cat, not an index gather: its backward is
    a plain sum per group, so gradients add up in the same order every run (an index_add
    backward may not), and resumed runs stay bitwise identical."""
    return torch.cat([t[g : g + 1].expand(n, *t.shape[1:]) for g, n in enumerate(runs)])
