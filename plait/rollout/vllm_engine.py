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
import gc
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.models import pad_id_of
from plait.rollout.hf import group_seed
from plait.rollout.precision import rollout_precision
from plait.rollout.weights import (
    TensorMeta,
    adapter_weights,
    full_weights,
    pushes_adapters,
    receive_buckets,
    weight_group,
    write_lora_adapter,
)
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
        dtype="bfloat16" if rollout_precision(cfg, device) == "bf16" else "float32",
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
    return {**kw, **lora_kwargs(cfg, device), **v.engine_kwargs}


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM takes for max_lora_rank


def vllm_lora_rank(r: int) -> int | None:
    """The smallest max_lora_rank vLLM takes that holds rank `r`; None above its largest."""
    return next((bound for bound in MAX_LORA_RANKS if bound >= r), None)


def lora_kwargs(cfg, device: torch.device) -> dict[str, Any]:
    """vLLM's own LoRA, for a run that pushes its adapter alone (model.lora; rollout.lora_push
    adapter, or auto off CPU: vLLM's CPU LoRA ops copy each token's adapter out before a
    matmul, bench/vllm_lora.py): the smallest rank bound vLLM takes that holds the run's r, one
    adapter live at a time (an update waits for the requests of the one before), and room for
    the next beside it while it loads. {} otherwise (merged weights are pushed)."""
    lora, push = cfg.model.lora, cfg.rollout.lora_push
    rank = vllm_lora_rank(lora.r) if lora is not None else None
    if rank is None or push == "merged" or (push == "auto" and device.type == "cpu"):
        return {}
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=2)


class Adapters:
    """The LoRA adapter versions a vLLM engine samples with: each push is written as a peft
    folder under a private temporary directory (in /dev/shm where there is one: memory, not
    disk) and loaded under a new adapter id, then the previous one is dropped."""

    def __init__(self):
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.root = Path(tempfile.mkdtemp(prefix="plait-lora-", dir=shm))
        self.current = None  # the LoRARequest generation uses

    def request(self, version: int):
        """Version `version`'s LoRARequest, its folder empty (a stale one is cleared)."""
        from vllm.lora.request import LoRARequest

        folder = self.root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        # ids must be unique per adapter and above 0; a resumed run's engine starts afresh
        return LoRARequest(f"plait-v{version}", version + 1, str(folder))

    def write(self, weights: list[tuple[str, torch.Tensor]], version: int):
        """Write version `version`'s adapter: (its LoRARequest, not yet in use; bytes written)."""
        request = self.request(version)
        return request, write_lora_adapter(weights, request.lora_path)

    def swap(self, request):
        """Use `request` from now on; the previous request, to be removed from the engine."""
        old, self.current = self.current, request
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return old

    def drop(self):
        """No adapter any more (a merged push replaced the base): the previous request, if any."""
        return self.swap(None)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def refused_adapter(e: Exception) -> ValueError:
    return ValueError(
        f"vLLM refused the LoRA adapter ({type(e).__name__}: {e}); it takes adapters on the linear layers of the "
        "models it supports LoRA for: adapt those (model.lora.target_modules) or push merged weights "
        "(rollout.lora_push=merged)"
    )


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

    def plait_receive_adapter(self, metas: list[list], buckets: list[list[int]], folder: str) -> int:
        """A LoRA adapter push: every worker takes its part in the broadcast, the first writes
        the adapter folder the engine then loads (its workers share a machine). Bytes written."""
        metas_ = [TensorMeta(n, d, tuple(s)) for n, d, s in metas]
        weights = [w for bucket in receive_buckets(self._plait_group, metas_, buckets, "cpu") for w in bucket]
        return write_lora_adapter(weights, folder) if self.rank == 0 else 0


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
        import torch.distributed as dist

        env_before = dict(os.environ)
        # a world group vLLM makes for itself is its to destroy; a trainer's (torchrun) is not
        self._owns_world = not (dist.is_available() and dist.is_initialized())
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
        self._env_set = {k: (env_before.get(k), v) for k, v in os.environ.items() if env_before.get(k) != v}
        self.pad_id = pad_id_of(tokenizer)
        self.adapters = Adapters() if kw.get("enable_lora") else None
        self._last_sync: dict[str, float] = {}

    def weights_for_round(self, version: int):
        """Load the trainer's weights after `version` rounds (once per version): the
        LoRA adapter alone where vLLM's LoRA is on and the adapter is all that trains, else the
        whole model (an adapter merged in)."""
        self._last_sync = {}
        if self.version != version:
            self._wake()
            t0 = time.perf_counter()
            with self.view() as model:
                if self.adapters is not None and pushes_adapters(model):
                    with adapter_weights(model) as weights:
                        nbytes = self._load_adapter(weights, version)
                    self._last_sync = {"weight_sync/gb": nbytes / 1e9, "weight_sync/adapter": 1.0}
                else:
                    with full_weights(model) as weights:
                        self.llm.collective_rpc("plait_load_weights", args=(weights,))
                    self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
                    self._remove(self.adapters.drop() if self.adapters is not None else None)
            self._last_sync["weight_sync/seconds"] = time.perf_counter() - t0
            self.version = version
        return contextlib.nullcontext()

    def _load_adapter(self, weights: list[tuple[str, torch.Tensor]], version: int) -> int:
        """Write and load version `version`'s adapter; the bytes written."""
        request, nbytes = self.adapters.write(weights, version)
        try:  # loaded now, so a refused adapter stops the run here and not mid-generation
            self.llm.llm_engine.add_lora(request)
        except Exception as e:
            raise refused_adapter(e) from e
        self._remove(self.adapters.swap(request))  # prompt KV is cached per adapter: nothing to reset
        return nbytes

    def _remove(self, request) -> None:
        if request is not None:
            self.llm.llm_engine.remove_lora(request.lora_int_id)

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        from vllm import SamplingParams as VSP

        self._wake()
        outs = self.llm.generate(
            [{"prompt_token_ids": p.token_ids} for p in prompts],
            [VSP(**sampling_dict(params, n, p)) for p in prompts],
            use_tqdm=False,
            lora_request=self.adapters.current if self.adapters is not None else None,
        )
        if self.sleeps:
            self.llm.sleep(level=1)  # weights to CPU, KV cache freed: training gets the memory
            self.asleep = True
        return [[to_completion(p, o, self.version) for o in output_dicts(ro)] for p, ro in zip(prompts, outs)]

    def stats(self) -> dict[str, float]:
        """The last load's seconds, and for an adapter the bytes written for vLLM to load (a
        merged load hands the trainer's tensors over in-process: nothing is sent)."""
        return dict(self._last_sync)

    def health(self) -> dict:
        """Colocated: an engine that died takes this process with it."""
        return {"engine": "vllm", "version": self.version}

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Drop the engine and leave the process as it was before: without the world group vLLM
        made for itself (a later engine would find it stale, and the trainer's collectives would
        take it for a process group of its own) and without the environment variables it set,
        which later child processes would inherit (OMP_NUM_THREADS, LD_PRELOAD, LOCAL_WORLD_SIZE...)."""
        if self.llm is None:
            return
        self.llm = None
        gc.collect()
        if self.adapters is not None:
            self.adapters.close()
        if self._owns_world:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        for key, (before, set_) in self._env_set.items():
            if os.environ.get(key) != set_:  # changed since by someone else: theirs now
                continue
            if before is None:
                del os.environ[key]
            else:
                os.environ[key] = before
