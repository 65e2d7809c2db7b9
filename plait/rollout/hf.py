"""A transformers-based engine: batched decoding with a KV cache, written out so that it can
return the sampling log-probs cheaply (one gathered value per token, never full-vocab
score tensors) and stop each sequence at EOS or a stop string.

It samples from the very module the trainer updates, so it needs no weight sync. On a CUDA GPU
each decoding step replays a captured graph over a static KV cache (rollout/graphs.py); on a CPU
the steps run eagerly through packed weight copies (rollout/packed.py) and, for a group's n
completions, one copy of their prompt's keys and values (rollout/prefix.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import torch
import torch.nn.functional as F

from plait.algo.logprobs import common_prefix
from plait.models import autocast, pad_id_of
from plait.rollout import graphs, prefix
from plait.rollout.fused import fused_norms
from plait.rollout.graphs import StaticDecoder
from plait.rollout.packed import (
    GROUPED,
    Bf16Copies,
    bf16_linears,
    bf16_packing_available,
    grouped_attention,
    int8_linears,
    packed_linears,
)
from plait.types import Completion, Prompt, SamplingParams


MIN_SHARED_TOKENS = 64  # prompt tokens a shared beginning must save before it gets a call of its own


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and attention mask, padded on the left so every row ends at the last column."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def group_seed(seed: int, prompt: Prompt) -> int:
    """The seed of one group's random stream: the step's seed and the prompt's dataset index.
    A group's completions don't depend on which other prompts share its batch, process or
    server replica, so 1 process and N processes sample the same completions."""
    return (seed * 1_000_003 + prompt.index) % (2**63)


def group_generators(prompts: list[Prompt], seed: int, device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(group_seed(seed, p)) for p in prompts]


def sample_next(
    logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator], group_of_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token per row (row i draws from its group's stream `gens[group_of_row[i]]`);
    return it and its log-prob under softmax(logits / T).

    The reported log-prob ignores top-k/top-p truncation: it is the number the trainer
    recomputes (TRL and vLLM report the same quantity), so the two can be compared.
    """
    logits = logits.float()
    if params.temperature == 0:
        token = logits.argmax(-1)
        logp = F.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        return token, logp
    logp_all = F.log_softmax(logits / params.temperature, -1)
    filtered = logp_all
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, descending=True, dim=-1)
        cum = sorted_lp.exp().cumsum(-1)
        drop_sorted = cum - sorted_lp.exp() > params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    u = torch.empty(len(filtered), dtype=torch.float64, device=filtered.device)
    for g in group_of_row.unique().tolist():
        rows = (group_of_row == g).nonzero().squeeze(-1)
        u[rows] = torch.rand(len(rows), dtype=torch.float64, generator=gens[g], device=filtered.device)
    token = inverse_cdf(filtered.softmax(-1), u)
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from `probs` [B, V] given uniforms `u` [B] in [0, 1): the first token
    whose cumulative probability exceeds u (a zero-probability token never is). One random
    number per row: torch.multinomial draws an exponential per vocabulary entry, a sizeable
    share of a CPU decode step for a large vocabulary."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)  # rounding can't pick past the last token


_PRECISION: contextvars.ContextVar[str | None] = contextvars.ContextVar("plait_decode_precision", default=None)


@contextlib.contextmanager
def decoding_in(precision: str):
    """While inside, HF engines in this process decode in `precision` instead of their own:
    evaluation measures the policy the trainer holds, whatever the rollouts sample in."""
    token = _PRECISION.set(precision)
    try:
        yield
    finally:
        _PRECISION.reset(token)


class HFEngine:
    """`model` gives the generation config and device; `view` (optional) is a context manager
    that yields the module to sample from: a sharded training backend gathers the full
    weights there (and frees them after)."""

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 64,
        precision: str = "fp32",
        view=None,
        packed_weights: bool = True,
        on_token=None,
        cuda_graphs: bool = True,
        fused_norms: bool = True,
    ):
        self.model = model
        # called before every forward pass: may swap new weights in, returns their version
        # (the generation process with in-flight updates; completions then carry token_versions)
        self.on_token = on_token
        self.packed_weights = packed_weights
        # on a CUDA GPU, decoding steps replay captured graphs (rollout/graphs.py); `static` is
        # the decoder that keeps them (tests set one with capture=False to run its steps anywhere)
        self.cuda_graphs = cuda_graphs
        self.static: StaticDecoder | None = None
        self.copies = Bf16Copies()  # bf16 weights for bf16 rollouts on a GPU, kept for graphs to read
        self.fused_norms = fused_norms  # torch's fused RMSNorm while decoding (rollout/fused.py)
        self.view = view or (lambda: contextlib.nullcontext(self.model))
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.precision = precision
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = sorted({e for e in [*eos, tokenizer.eos_token_id] if e is not None})
        self.pad_id = pad_id_of(tokenizer, self.eos_ids)

    def weights_for_round(self, version: int):
        """It samples from the trainer's own module: gather the weights (sharded backends) for
        the step's sampling, once, instead of per generate call."""
        return self.view()

    def stats(self) -> dict[str, float]:
        """No weights are copied (it samples from the trainer's module); with CUDA graphs, the
        time spent capturing them since the last call."""
        return self.static.stats() if self.static is not None and self.static.capture else {}

    def health(self) -> dict:
        """In this process, on the trainer's own weights: alive whenever this process is."""
        return {"engine": "hf", "version": None}

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def _packed(self, model, precision: str):
        """On CPU: decode through packed weight copies (see rollout/packed.py), bf16 ones for
        precision bf16, int8 ones for int8 (the output head then takes the fp32 path). On a GPU,
        bf16 decodes under autocast through bf16 copies of the weights (Bf16Copies). Yields the
        precision to autocast the forward passes to: bf16's packed CPU copies need none. On both,
        Llama-form RMSNorms run torch's fused kernel (rollout/fused.py)."""
        with contextlib.ExitStack() as stack:
            if self.fused_norms:
                stack.enter_context(fused_norms(model))
            if self._device.type != "cpu":
                if precision == "int8":
                    hint = "on a GPU use bf16, or vLLM's quantization"
                    raise ValueError(f"rollout.precision=int8 runs on CPU only: {hint}")
                if precision == "bf16" and self.packed_weights:
                    stack.enter_context(self.copies.linears(model))
                yield precision
                return
            stack.enter_context(grouped_attention(model))
            if precision == "int8":
                stack.enter_context(int8_linears(model))
            packed_bf16 = self.packed_weights and precision == "bf16" and bf16_packing_available()
            if packed_bf16:
                stack.enter_context(bf16_linears(model, self.batch_size))
            if self.packed_weights and precision in ("fp32", "int8"):
                stack.enter_context(packed_linears(model, self.batch_size))
            yield "fp32" if packed_bf16 else precision

    def _shares_prefix(self, model) -> bool:
        """A group's completions decode over one copy of their prompt's keys and values
        (rollout/prefix.py) where the grouped CPU attention runs and every layer attends to the
        whole sequence."""
        config = getattr(model, "config", None)
        return getattr(config, "_attn_implementation", None) == GROUPED and prefix.full_attention_only(config)

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        per_call = max(1, self.batch_size // n)  # whole groups per call: their prompt is prefilled once
        done: list[Completion] = []
        with self.view() as model, self._packed(model, _PRECISION.get() or self.precision) as precision:
            was_training = model.training
            model.eval()
            try:
                for start in range(0, len(prompts), per_call):
                    done += self._decode(model, prompts[start : start + per_call], n, params, precision)
            finally:
                model.train(was_training)
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _static_decoder(self, dev: torch.device) -> StaticDecoder | None:
        if self.static is None and self.cuda_graphs and dev.type == "cuda":
            self.static = StaticDecoder(capture=True)
        return self.static

    def _decode(self, model, prompts: list[Prompt], n: int, params: SamplingParams, precision: str) -> list[Completion]:
        """Prefill each distinct prompt once, then decode its n rows: on a GPU as replays of a
        captured graph over static buffers (rollout/graphs.py), else eagerly over one copy of the
        prompt's keys and values (rollout/prefix.py; where that does not apply, over n copies),
        dropping rows from the batch as soon as they finish."""
        from transformers import DynamicCache

        dev = next(model.parameters()).device
        gens = group_generators(prompts, params.seed, dev)
        rows = len(prompts) * n
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        reason = ["length"] * rows
        versions: list[list[int]] | None = [[] for _ in range(rows)] if self.on_token else None
        active = torch.arange(rows, device=dev)  # original row of each row still decoding
        cache = DynamicCache()
        version = self.on_token() if self.on_token else None
        # weights that arrive between tokens (on_token) change in place: no casts kept from before
        with autocast(self._device, precision, cache=self.on_token is None), prefix.decoding(cache):
            last, mask, last_pos = self._prefill(model, [p.token_ids for p in prompts], cache, dev)
            logits = last.repeat_interleave(n, 0)
            steps = self._steps(model, cache, mask, last_pos, n, params.max_tokens, precision)
            for t in range(params.max_tokens):
                token, logp = sample_next(logits, params, gens, active // n)
                live = active.tolist()
                keep = self._record(live, token.tolist(), logp.tolist(), tokens, logps, reason, params.stop)
                if versions is not None:
                    for row in live:
                        versions[row].append(version)
                if not keep or t == params.max_tokens - 1:
                    break
                if len(keep) < len(active):
                    idx = torch.tensor(keep, device=dev)
                    steps.select(idx)
                    active, token = active[idx], token[idx]
                if self.on_token:
                    version, before = self.on_token(), version
                    if version != before:
                        self.copies.refresh()
                        steps.weights_changed(model)
                logits = steps.next(model, token, active)
        done = self._collect([p for p in prompts for _ in range(n)], tokens, logps, reason, params)
        for c, v in zip(done, versions or []):
            c.token_versions = v[: len(c.token_ids)]
            c.weight_version = min(c.token_versions, default=None)
        return done

    def _prefill(self, model, prompts: list[list[int]], cache, dev: torch.device):
        """Run the prompts into `cache`: the beginning they all share (a system prompt, worked
        examples) once, its keys and values then read by every prompt's own rest, where that
        saves enough tokens to pay for the extra call; else every prompt whole. Returns the logits
        at each prompt's last token [G, V], the prompts' attention mask [G, W] (the shared
        beginning's columns first) and each prompt's last position [G, 1]."""
        head = common_prefix(prompts) if prefix.full_attention_only(getattr(model, "config", None)) else 0
        if head * (len(prompts) - 1) < MIN_SHARED_TOKENS:
            head = 0
        if head:
            model(
                input_ids=torch.tensor(prompts[0][:head], device=dev)[None],
                position_ids=torch.arange(head, device=dev)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=torch.empty(0, dtype=torch.long, device=dev),
            )
            for layer in cache.layers:  # one copy read by every prompt (the rest's prefill appends to it)
                layer.keys = layer.keys.expand(len(prompts), -1, -1, -1)
                layer.values = layer.values.expand(len(prompts), -1, -1, -1)
        ids, mask = left_pad([p[head:] for p in prompts], self.pad_id)
        ids, mask = ids.to(dev), mask.to(dev)
        pos = head + (mask.cumsum(-1) - 1).clamp(min=0)
        if head:
            mask = torch.cat([torch.ones(len(prompts), head, dtype=mask.dtype, device=dev), mask], 1)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1], mask, pos[:, -1:]

    def _steps(self, model, cache, mask, last_pos, n: int, max_new: int, precision: str):
        """How the decoding steps after the prefill run: a static bucket (graphed on a GPU) where
        it applies, else eagerly on the prefill's cache."""
        static = self._static_decoder(mask.device)
        if static is not None and graphs.applies(model, cache):
            try:
                bucket = static.prepare(model, cache, mask, last_pos, n, max_new, self.batch_size, precision)
                return _StaticSteps(static, bucket)
            except Exception as e:  # a forward that cannot be captured (a host sync, a sharding hook)
                if not static.capture:
                    raise
                warnings.warn(f"CUDA graph capture failed ({e}); this engine decodes eagerly (rollout.cuda_graphs)")
                self.static, self.cuda_graphs = None, False
        shared = n > 1 and self._shares_prefix(model) and prefix.share_prefix(cache, mask, n, max_new)
        if n > 1 and not shared:
            cache.batch_repeat_interleave(n)
        return _EagerSteps(cache, mask.repeat_interleave(n, 0), last_pos.repeat_interleave(n, 0), shared)

    def _record(self, active, toks, lps, tokens, logps, reason, stops) -> list[int]:
        """Append this step's token to each active row; return the positions still decoding."""
        keep = []
        for j, row in enumerate(active):
            tokens[row].append(toks[j])
            logps[row].append(lps[j])
            if toks[j] in self.eos_ids:
                reason[row] = "eos"
            elif stops and any(s in self.tokenizer.decode(tokens[row][-8:]) for s in stops):
                reason[row] = "stop"
            else:
                keep.append(j)
        return keep

    def _collect(self, prompts, tokens, logps, reason, params) -> list[Completion]:
        out = []
        for i, p in enumerate(prompts):
            row = tokens[i]
            end = self._stop_end(row, params.stop) if reason[i] == "stop" else len(row)
            kept = row[:end]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            for s in params.stop if reason[i] == "stop" else []:
                if s in text:
                    text = text[: text.index(s) + len(s)]
            out.append(
                Completion(
                    prompt_index=p.index,
                    token_ids=kept,
                    text=text,
                    logprobs=logps[i][:end],
                    truncated=reason[i] == "length",
                    finish_reason=reason[i],
                )
            )
        return out

    def _stop_end(self, row: list[int], stops: list[str]) -> int:
        """Smallest prefix length whose text contains a stop string."""
        for end in range(1, len(row) + 1):
            if any(s in self.tokenizer.decode(row[:end]) for s in stops):
                return end
        return len(row)


class _EagerSteps:
    """Decoding steps on a growing cache; finished rows leave the batch."""

    def __init__(self, cache, mask: torch.Tensor, last_pos: torch.Tensor, shared: bool):
        self.cache, self.mask, self.last_pos, self.shared = cache, mask, last_pos, shared

    def weights_changed(self, model) -> None:
        pass  # each step reads the module's tensors afresh

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.mask, self.last_pos = self.mask[idx], self.last_pos[idx]

    def next(self, model, token: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(token), 1))], dim=1)
        self.last_pos = self.last_pos + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=None if self.shared else self.mask,  # the shared prefix's attention masks its own
            position_ids=self.last_pos,
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1]


class _StaticSteps:
    """Decoding steps in a static bucket: finished rows keep their slot, their output unread;
    weights that moved mid-call (an in-flight update replacing tensors) are captured again."""

    def __init__(self, decoder: StaticDecoder, bucket):
        self.decoder, self.bucket = decoder, bucket

    def weights_changed(self, model) -> None:
        self.decoder.refresh(self.bucket, model)

    def select(self, idx: torch.Tensor) -> None:
        pass

    def next(self, model, token: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        return self.bucket.step(model, token, active)
