"""Decoding a group's n completions over one copy of their prompt's keys and values.

GRPO samples n completions per prompt, so after the prompt is prefilled once, the usual way
(transformers' `batch_repeat_interleave`) copies its keys and values to n rows, and every
decoding step then grows each row's cache by concatenation: on a CPU, a copy of the whole cache
per layer per step. In the demo's generation call (8 prompts of 138 tokens x 8 completions, Zen 5)
that concatenation was 24% of the time and the attention's reads of n equal copies another 7%.

Here the prompt's keys and values stay one per group; each row keeps only its own new tokens,
written in place into a buffer sized for the whole decode. A decoding step's attention scores
each row's query against its group's prompt (the queries of a group's rows and shared heads
multiplied at once) and against its own tokens, one softmax over both. The result is the same
attention to float rounding (tests/unit/test_cpu_fast_paths.py compares it with the copying
path: the same tokens, log-probs within 1e-4).

It applies to models whose every layer attends to the whole sequence (no sliding window, no
logit soft-capping, no attention sinks) and run transformers' sdpa attention; others decode as
before.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("plait_shared_prefix", default=None)


def dynamic_layer():
    """transformers' DynamicLayer (imported when first needed)."""
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def full_attention_only(config) -> bool:
    """Every layer attends to the whole sequence, with plain softmax attention."""
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    if types is None and getattr(config, "sliding_window", None) is not None:
        return False
    return all(getattr(config, k, None) is None for k in ("attn_logit_softcapping", "final_logit_softcapping"))


class SharedPrefixLayer(dynamic_layer()):
    """One layer's cache: the prompt's keys/values once per group, [G, kv heads, P, d], and a
    buffer for each row's own new tokens, [rows, kv heads, max_new, d]. `update` returns the rows'
    own tokens; attend() adds the prompt."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prompt_mask: torch.Tensor, n: int, max_new: int):
        super().__init__()
        groups, heads, _, dim = keys.shape
        self.prefix_keys, self.prefix_values = keys, values
        self.prompt_mask = prompt_mask  # [G, P], False at the left padding
        self.n = n
        self.slot = torch.arange(groups * n, device=keys.device)  # each row's place among G x n
        self.keys = keys.new_empty(groups * n, heads, max_new, dim)
        self.values = values.new_empty(groups * n, heads, max_new, dim)
        self.length = 0
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2] + self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a shared-prefix cache is already one row per completion")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (ascending): only their own tokens are copied."""
        self.slot = self.slot[indices]
        keys, values = torch.empty_like(self.keys[: len(indices)]), torch.empty_like(self.values[: len(indices)])
        keys[:, :, : self.length] = self.keys[indices, :, : self.length]
        values[:, :, : self.length] = self.values[indices, :, : self.length]
        self.keys, self.values = keys, values

    def _to_groups(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, kv heads, q, k] -> [G, kv heads, n * q, k]: each group's rows side by side
        (rows that finished already are zero)."""
        groups = self.prompt_mask.shape[0]
        full = x.new_zeros(groups * self.n, *x.shape[1:])
        full[self.slot] = x
        heads, q, k = x.shape[1:]
        return full.view(groups, self.n, heads, q, k).transpose(1, 2).reshape(groups, heads, self.n * q, k)

    def _to_rows(self, x: torch.Tensor, q: int) -> torch.Tensor:
        """The inverse of _to_groups for the rows still decoding."""
        groups, heads, _, k = x.shape
        return x.view(groups, heads, self.n, q, k).transpose(1, 2).reshape(groups * self.n, heads, q, k)[self.slot]

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
        """One decoding step: query [rows, heads, 1, d], this layer's own-token keys/values
        [rows, kv heads, t, d]; returns [rows, 1, heads, d] as transformers' attention does."""
        rows, heads, _, dim = query.shape
        shared = keys.shape[1]
        per = heads // shared
        q = query.reshape(rows, shared, per, dim)
        prompt = self._to_rows(self._to_groups(q) @ self.prefix_keys.transpose(-1, -2), per)
        visible = self.prompt_mask[self.slot // self.n][:, None, None, :]
        prompt = prompt.masked_fill(~visible, float("-inf"))
        scores = torch.cat([prompt, q @ keys.transpose(-1, -2)], -1) * scaling
        probs = scores.float().softmax(-1).to(values.dtype)
        p_prompt, p_own = probs.split([prompt.shape[-1], keys.shape[-2]], -1)
        out = self._to_rows(self._to_groups(p_prompt) @ self.prefix_values, per) + p_own @ values
        return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


def share_prefix(cache, prompt_mask: torch.Tensor, n: int, max_new: int) -> bool:
    """Turn a prefilled DynamicCache (one row per prompt) into shared-prefix layers for n
    completions per prompt, in place. False (cache untouched) where a layer is not a plain
    full-attention DynamicLayer."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not dynamic_layer() for layer in layers):
        return False
    mask = prompt_mask.bool()
    cache.layers = [SharedPrefixLayer(layer.keys, layer.values, mask, n, max_new) for layer in layers]
    return True


@contextlib.contextmanager
def decoding(cache):
    """While inside, attention() serves this cache's decoding steps."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def attention(module, query, key, value, scaling, kwargs) -> torch.Tensor | None:
    """The shared-prefix attention of a decoding step, or None where it does not apply (the
    cache in use is not a shared-prefix one, or a prefill)."""
    cache = _ACTIVE.get()
    layer = None if cache is None else cache.layers[module.layer_idx]
    if not isinstance(layer, SharedPrefixLayer) or query.shape[-2] != 1:
        return None
    for k in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(k) is not None:
            raise RuntimeError(f"shared-prefix decoding has no attention {k}: share_prefix should not have applied")
    return layer.attend(query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling)
