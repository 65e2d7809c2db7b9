"""vLLM generation, colocated with training (this file) or on its own processes (server.py).

What both modes share lives here: the mapping of plait's sampling parameters onto vLLM's,
of vLLM's outputs onto plait's `Completion`, the engine arguments derived from the run's
config, and the worker extension through which new weights reach vLLM's workers.

Colocated, each training process owns an in-process vLLM engine on its own device; after each
optimizer step the trainer hands it the new weights directly (no copy through a socket).
On GPU the engine sleeps while the trainer trains, so training gets its memory back.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any

import numpy as np
import torch

from plait.models import pad_id_of
from plait.rollout.hf import group_seed
from plait.rollout.weights import TensorMeta, full_weights, receive_buckets, weight_group
from plait.types import Completion, Prompt, SamplingParams


def sampling_dict(params: SamplingParams, n: int, prompt: Prompt) -> dict[str, Any]:
    """vLLM SamplingParams keyword arguments for one prompt's group (plain data: it also
    travels to a rollout server as JSON)."""
    greedy = params.temperature == 0
    return dict(
        n=n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy else params.top_k,  # 0 = no top-k
        stop=list(params.stop) or None,
        include_stop_str_in_output=True,  # the text ends with its stop string, as the HF engine's
        seed=group_seed(params.seed, prompt),  # the group's own stream, as in the HF engine
        logprobs=0,  # the sampled token's log-prob only
    )


def output_dicts(request_output) -> list[dict[str, Any]]:
    """The fields plait keeps of one vLLM RequestOutput (plain data, JSON-safe)."""
    return [
        dict(
            token_ids=list(c.token_ids),
            text=c.text,
            logprobs=[lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs or [])],
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in request_output.outputs
    ]


def to_completion(prompt: Prompt, out: dict[str, Any], weight_version: int | None) -> Completion:
    """vLLM says finish_reason 'stop' for both EOS and stop strings; its stop_reason tells them
    apart (None or a token id: EOS / a stop token; a string: that stop string)."""
    if "reason" in out:  # the HF generation process says it in plait's words
        reason = out["reason"]
    elif out["finish_reason"] == "length":
        reason = "length"
    else:
        reason = "stop" if isinstance(out["stop_reason"], str) else "eos"
    versions = out.get("token_versions")
    return Completion(
        prompt_index=prompt.index,
        token_ids=out["token_ids"],
        text=out["text"],
        logprobs=out["logprobs"],
        truncated=reason == "length",
        finish_reason=reason,
        weight_version=min(versions) if versions else weight_version,
        token_versions=versions or None,
    )


def engine_kwargs(cfg, model_path: str, device: torch.device, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """vLLM engine arguments from a plait config (both modes use these, so the server samples
    exactly like a colocated engine would)."""
    v = cfg.rollout.vllm
    longest = max(cfg.rollout.max_completion_length, cfg.eval.max_completion_length or 0)
    kw: dict[str, Any] = dict(
        model=model_path,
        dtype="bfloat16" if cfg.train.precision == "bf16" else "float32",
        seed=cfg.seed,
        max_model_len=v.max_model_len or cfg.data.max_prompt_length + longest,
        tensor_parallel_size=tensor_parallel_size,
        enable_prefix_caching=v.enable_prefix_caching,
        # CPU: torch.compile of the model costs minutes on two cores; eager decodes fine there
        enforce_eager=v.enforce_eager if v.enforce_eager is not None else device.type == "cpu",
        logprobs_mode="processed_logprobs",  # after temperature: the numbers the trainer recomputes
        max_num_seqs=v.max_num_seqs,
        worker_extension_cls="plait.rollout.vllm_engine.WeightReceiver",
        disable_log_stats=True,
    )
    if device.type == "cpu":
        # vLLM's CPU runner rewinds a seeded request's generator when a chunked prefill step
        # discards its sample, which CPU generators can't do ("CPU Generator does not use
        # offset"): every group is seeded, so prompts are prefilled whole on CPU
        kw["enable_chunked_prefill"] = False
    if v.kv_cache_gb is not None or device.type == "cpu":
        kw["kv_cache_memory_bytes"] = int((v.kv_cache_gb or 1.0) * 2**30)
    else:
        kw["gpu_memory_utilization"] = v.gpu_memory_utilization
    return {**kw, **v.engine_kwargs}


def cpu_environment(threads: int) -> None:
    """vLLM's CPU worker pins OpenMP threads to cores and drops torch to one thread unless told
    otherwise; a colocated engine shares the process with training, so keep torch's threads."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


class WeightReceiver:
    """Methods vLLM mixes into each of its workers (`worker_extension_cls`): join the trainer's
    weight group, then receive bucketed broadcasts and load them into the model."""

    def plait_load_weights(self, weights) -> None:
        """In-process (colocated): `weights` are the trainer's own tensors."""
        self._plait_reload(iter(weights))

    def _plait_reload(self, weights) -> None:
        """vLLM's in-place reload redoes the per-layer processing its kernels need (a plain
        load_weights can't, after it). It processes a tied weight for one of its owners only (the
        embedding); the others (a tied lm_head, whose CPU kernel packed its own copy) are redone here."""
        self.model_runner.reload_weights(weights_iterator=weights)
        owners: dict[int, list] = {}
        for m in self.model_runner.get_model().modules():
            w, method = getattr(m, "weight", None), getattr(m, "quant_method", None)
            if isinstance(w, torch.nn.Parameter) and method is not None:
                owners.setdefault(id(w), []).append(m)
        for shared in owners.values():
            for m in shared[1:]:
                m.quant_method.process_weights_after_loading(m)

    def plait_join_weight_group(
        self, host: str, port: int, rank_offset: int, world: int, backend: str, timeout_s: float
    ) -> None:
        self._plait_group = None  # a new trainer (e.g. after a restart) replaces the old group
        self._plait_group = weight_group(host, port, rank_offset + self.rank, world, backend, timeout_s)

    def plait_receive_weights(self, metas: list[list], buckets: list[list[int]]) -> int:
        metas_ = [TensorMeta(n, d, tuple(s)) for n, d, s in metas]
        received = (w for bucket in receive_buckets(self._plait_group, metas_, buckets, self.device) for w in bucket)
        self._plait_reload(received)  # buckets arrive as the loader consumes them
        for _ in received:  # a loader that skipped some must not leave the trainer's broadcasts hanging
            pass
        return len(metas_)


@contextlib.contextmanager
def _rng_kept():
    """vLLM seeds the global RNGs when it starts; the trainer's streams must not notice."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class VLLMEngine:
    """A vLLM engine inside the training process (rollout.vllm.mode=colocate)."""

    def __init__(self, cfg, model_path: str, tokenizer, view, device: torch.device):
        # The engine core and worker run in this process, so new weights are loaded from the
        # trainer's tensors directly (set before vLLM is imported)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # plait's console stays readable
        if device.type == "cpu":
            cpu_environment(torch.get_num_threads())
        from vllm import LLM

        self.view = view
        self.version: int | None = None
        self.sleeps = cfg.rollout.vllm.sleep_between_steps and device.type == "cuda"
        self.asleep = False
        kw = engine_kwargs(cfg, model_path, device)
        if self.sleeps:
            kw["enable_sleep_mode"] = True
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        with _rng_kept():
            self.llm = LLM(**kw)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op; the trainer keeps its own
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        self.pad_id = pad_id_of(tokenizer)

    def weights_for_step(self, version: int):
        """Load the trainer's weights after `version` optimizer steps (once per version)."""
        if self.version != version:
            self._wake()
            with self.view() as model, full_weights(model) as weights:
                self.llm.collective_rpc("plait_load_weights", args=(weights,))
                self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
            self.version = version
        return contextlib.nullcontext()

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        from vllm import SamplingParams as VSP

        self._wake()
        outs = self.llm.generate(
            [{"prompt_token_ids": p.token_ids} for p in prompts],
            [VSP(**sampling_dict(params, n, p)) for p in prompts],
            use_tqdm=False,
        )
        if self.sleeps:
            self.llm.sleep(level=1)  # weights to CPU, KV cache freed: training gets the memory
            self.asleep = True
        return [[to_completion(p, o, self.version) for o in output_dicts(ro)] for p, ro in zip(prompts, outs)]

    def stats(self) -> dict[str, float]:
        """No weight-sync metrics: the weights are handed over in-process."""
        return {}

    def health(self) -> dict:
        """Colocated: an engine that died takes this process with it."""
        return {"engine": "vllm", "version": self.version}

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        del self.llm
