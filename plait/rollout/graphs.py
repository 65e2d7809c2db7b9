"""Decoding on a GPU as replays of a captured CUDA graph.

An eager decoding step of a small model on a GPU is bound by launching its kernels from Python
(SmolLM2-135M: 1,333 kernels in an eager step of 64 rows, 17-19 ms a step on an H200 where the
weights take ~0.1 ms to read; bench/decode.py --profile).
Here each step instead runs one captured graph over static buffers:

- the keys and values of every layer live in one buffer per bucket, [rows, kv heads, length, d],
  written in place at the step's column (a device tensor), so every replay reads and writes the
  same memory;
- the attention mask is computed inside the graph from the prompts' padding and that column, so
  it needs no Python between steps;
- buckets are keyed by rows (the next power of two, at most the engine's batch size) and length
  (prompt width + max new tokens, rounded up to 128): a later call of the same shape replays the
  graph captured earlier. The time spent capturing is counted and reported.

Rows that finish stay in their slot and their output is ignored (a step over 64 rows costs about
what one over 8 does while the GPU is launch-bound), so nothing is recaptured when rows end. The
prompt of a group is prefilled once (eagerly) and its keys and values copied to its n rows.

The graph holds the addresses of the module's parameters: the optimizer updates them in place, so
the same graph samples from the new weights; if a parameter is replaced (a sharded backend's
gathered view, a weight swap), the graphs are captured again.

Sampling stays outside the graph (plait's per-group random streams, log-probs and stop checks
are the eager path's): the graphed forward gives the same logits as the eager one to float
rounding, so the same tokens for the same seed (tests/gpu/test_cuda.py compares them).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import torch

from plait.rollout import prefix


LENGTH_STEP = 128
MAX_BUCKETS = 2  # each holds a KV cache of its own: a run's training rounds and its evaluation


def bucket_rows(rows: int, batch_size: int) -> int:
    """The next power of two at or above `rows`, at most max(batch_size, rows)."""
    return min(1 << max(rows - 1, 0).bit_length(), max(batch_size, rows))


def bucket_length(tokens: int) -> int:
    return -(-tokens // LENGTH_STEP) * LENGTH_STEP


def applies(model, prefill_cache) -> bool:
    """Every layer attends to the whole sequence (one mask serves them all) and the prefill
    left plain keys/values per layer."""
    layers = getattr(prefill_cache, "layers", None)
    return (
        prefix.full_attention_only(getattr(model, "config", None))
        and bool(layers)
        and all(type(layer) is prefix.dynamic_layer() for layer in layers)
    )


def signature(model) -> tuple[int, ...]:
    """Where the module's tensors live: a captured graph reads them there."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class StaticLayer(prefix.dynamic_layer()):
    """One layer's keys and values for a bucket's rows, written in place at `column`."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.column, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a static bucket's rows are fixed")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a static bucket's rows are fixed: finished rows stay in their slot")


class Bucket:
    """Static inputs, KV buffers and (once captured) the graph of one decoding step."""

    def __init__(self, rows: int, length: int, like: list[tuple[torch.Tensor, torch.Tensor]], precision: str):
        from transformers import DynamicCache

        dev = like[0][0].device
        self.precision = precision
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.column = torch.zeros(1, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, length, dtype=torch.bool, device=dev)
        self.columns = torch.arange(length, device=dev)
        self.cache = DynamicCache()
        self.cache.layers = [
            StaticLayer(
                k.new_zeros(rows, k.shape[1], length, k.shape[3]),
                v.new_zeros(rows, v.shape[1], length, v.shape[3]),
                self.column,
            )
            for k, v in like
        ]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.signature: tuple[int, ...] | None = None

    def fits(self, like) -> bool:
        return len(like) == len(self.cache.layers) and all(
            k.dtype == layer.keys.dtype and k.shape[1] == layer.keys.shape[1] and k.shape[3] == layer.keys.shape[3]
            for (k, _), layer in zip(like, self.cache.layers)
        )

    def load(self, prefill_cache, prompt_mask: torch.Tensor, last_pos: torch.Tensor, n: int) -> None:
        """The prefilled prompts (one row each, width P) as rows 0..G*n-1, n copies each; the first
        decoding step writes column P."""
        groups, width = prompt_mask.shape
        rows = groups * n
        for layer, src in zip(self.cache.layers, prefill_cache.layers):
            layer.keys[:rows, :, :width] = src.keys.repeat_interleave(n, 0)
            layer.values[:rows, :, :width] = src.values.repeat_interleave(n, 0)
        self.valid.fill_(True)
        self.valid[:rows, :width] = prompt_mask.bool().repeat_interleave(n, 0)
        self.valid[rows:, 1:] = False  # idle rows attend to one column: finite, ignored
        self.position.zero_()
        self.position[:rows] = last_pos.repeat_interleave(n, 0)
        self.column.fill_(width - 1)

    def _forward(self, model) -> torch.Tensor:
        mask = (self.valid & (self.columns <= self.column))[:, None, None, :]
        # autocast's weight cache would hold casts made during capture (torch.cuda.graphs' advice)
        cast = torch.autocast(self.ids.device.type, torch.bfloat16, cache_enabled=False)
        with cast if self.precision == "bf16" else contextlib.nullcontext():
            out = model(
                input_ids=self.ids,
                attention_mask=mask,
                position_ids=self.position,
                past_key_values=self.cache,
                use_cache=True,
            )
        return out.logits[:, -1]

    def capture(self, model) -> None:
        """Warm up on a side stream (torch.cuda.graphs' recipe), then capture one step. The
        warm-up writes the next column, which the first real step overwrites."""
        self.graph = None
        self.column += 1
        stream = torch.cuda.Stream(device=self.ids.device)
        stream.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(model)
        torch.cuda.current_stream(self.ids.device).wait_stream(stream)
        self.column -= 1
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of this process (a weight receiver, say) may use the GPU meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward(model)
        self.graph = graph
        self.signature = signature(model)

    def step(self, model, token: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Feed each active row its sampled token; return the active rows' next logits."""
        self.ids[active, 0] = token
        self.position += 1
        self.column += 1
        if self.graph is None:
            return self._forward(model)[active]
        self.graph.replay()
        return self.logits[active]


class StaticDecoder:
    """An engine's buckets, kept across generate calls so a round replays the last round's
    graphs. capture=False runs the same static steps without a graph (any device): what the
    tests compare the graph with, and the same arithmetic."""

    def __init__(self, capture: bool = True):
        self.capture = capture
        self.buckets: OrderedDict[tuple, Bucket] = OrderedDict()
        self.capture_s = 0.0
        self.captures = 0

    def prepare(self, model, prefill_cache, prompt_mask, last_pos, n: int, max_new: int, batch_size: int, precision):
        """A bucket loaded with the prefilled prompts, its graph captured for these weights."""
        like = [(layer.keys, layer.values) for layer in prefill_cache.layers]
        rows = bucket_rows(prompt_mask.shape[0] * n, batch_size)
        key = (rows, bucket_length(prompt_mask.shape[1] + max_new), like[0][0].dtype, precision)
        bucket = self.buckets.pop(key, None)
        if bucket is None or not bucket.fits(like):
            try:
                bucket = Bucket(key[0], key[1], like, precision)
            except torch.OutOfMemoryError:  # the other buckets' caches go first, then once more
                self.buckets.clear()
                torch.cuda.empty_cache()
                bucket = Bucket(key[0], key[1], like, precision)
        self.buckets[key] = bucket  # most recently used last
        while len(self.buckets) > MAX_BUCKETS:
            self.buckets.popitem(last=False)
        bucket.load(prefill_cache, prompt_mask, last_pos, n)
        self.refresh(bucket, model)
        return bucket

    def refresh(self, bucket: Bucket, model) -> None:
        """Capture (again) where the graph is missing or the weights moved."""
        if not self.capture or (bucket.graph is not None and bucket.signature == signature(model)):
            return
        start = time.perf_counter()
        bucket.capture(model)
        torch.cuda.synchronize(bucket.ids.device)
        self.capture_s += time.perf_counter() - start
        self.captures += 1

    def stats(self) -> dict[str, float]:
        """Capture time and count since the last call (each round's metrics)."""
        out = {"rollout/graph_capture_s": self.capture_s, "rollout/graph_captures": float(self.captures)}
        self.capture_s, self.captures = 0.0, 0
        return out
