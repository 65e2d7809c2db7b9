"""The pieces of vLLM generation that need no engine: weight buckets, the weight group,
the sampling/output mapping, the config checks and a missing server's error."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

import pytest
import torch

from plait.comm import free_port
from plait.config import ConfigError, load_config, validate
from plait.rollout.vllm_engine import sampling_dict, to_completion
from plait.rollout.weights import (
    TensorMeta,
    full_weights,
    metas_of,
    plan_buckets,
    receive_buckets,
    send_buckets,
    weight_group,
)
from plait.types import Prompt, SamplingParams


def test_buckets_keep_one_dtype_and_respect_the_size():
    metas = [
        TensorMeta("a", "float32", (256,)),
        TensorMeta("b", "bfloat16", (10,)),
        TensorMeta("c", "float32", (256,)),
        TensorMeta("d", "float32", (1024,)),
        TensorMeta("e", "float32", (4,)),
    ]
    buckets = plan_buckets(metas, bucket_bytes=2048)
    assert sorted(i for b in buckets for i in b) == list(range(5))  # every tensor exactly once
    for b in buckets:
        assert len({metas[i].dtype for i in b}) == 1
        assert sum(metas[i].nbytes for i in b) <= 2048 or len(b) == 1  # an oversized tensor goes alone
    assert [0, 2] in buckets and [3] in buckets  # 1 KiB + 1 KiB fill one bucket; 4 KiB gets its own


def _receiver(port, metas, buckets, q):
    try:
        group = weight_group("127.0.0.1", port, 1, 2, "gloo", 120)
        q.put(
            {n: t.clone() for bucket in receive_buckets(group, metas, buckets, torch.device("cpu")) for n, t in bucket}
        )
    except Exception as e:  # reported by the test instead of a bare timeout
        q.put(f"receiver failed: {type(e).__name__}: {e}")


def test_bucketed_broadcast_delivers_every_tensor_intact():
    weights = [("w1", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("w2", torch.randn(2, 2, 2))]
    metas = metas_of(weights)
    buckets = plan_buckets(metas, bucket_bytes=64)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port, metas, buckets, q))
    p.start()
    group = weight_group("127.0.0.1", port, 0, 2, "gloo", 120)
    send_buckets(group, [t for _, t in weights], buckets, torch.device("cpu"))
    got = q.get(timeout=180)
    p.join(60)
    assert isinstance(got, dict), got
    for name, t in weights:
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype


def test_full_weights_lists_tied_weights_once_and_merges_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    with full_weights(model) as w:
        names = [n for n, _ in w]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    base_q = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    with full_weights(peft) as w:
        merged = dict(w)
        assert set(merged) == set(names)  # the base checkpoint's names, no adapter tensors
        assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base_q)  # the adapter is in
    assert torch.equal(
        peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, base_q
    )  # unmerged after


def test_sampling_and_outputs_map_to_plait_terms():
    prompt = Prompt(index=12, text="", token_ids=[1, 2])
    greedy = sampling_dict(
        SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, stop=["</s>"], seed=9), 1, prompt
    )
    assert greedy["top_p"] == 1.0 and greedy["top_k"] == 0 and greedy["logprobs"] == 0 and greedy["stop"] == ["</s>"]
    s1 = sampling_dict(SamplingParams(max_tokens=5, seed=9), 4, prompt)["seed"]
    s2 = sampling_dict(SamplingParams(max_tokens=5, seed=9), 4, Prompt(index=13, text="", token_ids=[1]))["seed"]
    assert s1 != s2  # each group its own stream
    base = dict(token_ids=[5, 6], text="x", logprobs=[-0.1, -0.2])
    assert to_completion(prompt, {**base, "finish_reason": "length", "stop_reason": None}, 3).truncated
    eos = to_completion(prompt, {**base, "finish_reason": "stop", "stop_reason": None}, 3)
    stop = to_completion(prompt, {**base, "finish_reason": "stop", "stop_reason": "</s>"}, 3)
    assert (eos.finish_reason, stop.finish_reason, eos.weight_version, eos.prompt_index) == ("eos", "stop", 3, 12)


def problems(*overrides):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, list(overrides)), world_size=4)
    return err.value.problems


def test_engine_config_problems_say_what_works():
    (p,) = [
        p
        for p in problems(
            "cluster.devices=4", "cluster.generation_devices=1", "rollout.engine=vllm", "rollout.prompts_per_step=3"
        )
        if "generation_devices" in p
    ]
    assert "rollout.vllm.mode=server" in p
    (p,) = [
        p
        for p in problems("rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2", "rollout.prompts_per_step=3")
        if "tensor_parallel" in p
    ]
    assert "mode=server" in p
    found = problems(
        "rollout.engine=vllm",
        "rollout.vllm.mode=server",
        "rollout.vllm.servers=[gen-node:8000]",
        "rollout.prompts_per_step=3",
    )
    assert any("not an http(s) URL" in p for p in found)
    found = problems(
        "cluster.devices=4",
        "cluster.generation_devices=1",
        "rollout.engine=vllm",
        "rollout.vllm.mode=server",
        "rollout.vllm.tensor_parallel_size=2",
        "rollout.prompts_per_step=3",
    )
    assert any("2 x 1 = 2 devices" in p for p in found)
    # and the seed-004 layout with a server works: 3 trainers + 1 generation GPU
    plan = validate(
        load_config(
            None,
            [
                "cluster.devices=4",
                "cluster.generation_devices=1",
                "rollout.engine=vllm",
                "rollout.vllm.mode=server",
                "rollout.prompts_per_step=3",
                "rollout.num_generations=8",
                "train.micro_batch_size=8",
            ],
        )
    )
    assert plan.training_processes == 3


def test_no_server_is_an_error_naming_the_fix_not_a_hang():
    from plait.rollout.remote import RemoteEngine, RolloutServerError

    port = free_port()  # nothing listens there
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "rollout.vllm.mode=server",
            f"rollout.vllm.servers=[http://127.0.0.1:{port}]",
            "rollout.vllm.connect_timeout_s=2",
        ],
    )
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    start = time.monotonic()
    with pytest.raises(RolloutServerError) as err:
        RemoteEngine(cfg, tok, view=None, device=torch.device("cpu"))
    assert time.monotonic() - start < 60  # gave up (after connect_timeout_s), did not hang
    msg = str(err.value)
    assert (
        f"no rollout server at http://127.0.0.1:{port}" in msg
        and "plait rollout-server" in msg
        and "Connection refused" in msg
    )


def test_engine_arguments_follow_the_run_config():
    from plait.rollout.vllm_engine import engine_kwargs

    cfg = load_config(
        None,
        [
            "train.precision=bf16",
            "data.max_prompt_length=100",
            "rollout.max_completion_length=50",
            "eval.max_completion_length=80",
            "rollout.vllm.engine_kwargs={quantization: fp8}",
        ],
    )
    cpu = engine_kwargs(cfg, "/m", torch.device("cpu"))
    assert (cpu["dtype"], cpu["max_model_len"], cpu["enforce_eager"]) == ("bfloat16", 180, True)
    assert cpu["kv_cache_memory_bytes"] == 2**30 and not cpu["enable_chunked_prefill"] and cpu["quantization"] == "fp8"
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["worker_extension_cls"].endswith("WeightReceiver")
    gpu = engine_kwargs(cfg, "/m", torch.device("cuda"), tensor_parallel_size=2)
    assert gpu["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in gpu and not gpu["enforce_eager"]
    assert gpu["tensor_parallel_size"] == 2 and "enable_chunked_prefill" not in gpu
