"""The pieces of vLLM generation that need no engine: weight buckets, the weight group,
the sampling/output mapping, the config checks and a missing server's error."""

from __future__ import annotations

import json
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


def test_an_adapter_push_written_as_a_peft_folder_loads_as_the_same_adapter(tmp_path):
    """vLLM loads an adapter push from the folder write_lora_adapter makes: peft reading that
    folder back onto the base model computes what the trained adapter computes (each layer's
    scale folded into B; lora_alpha = r)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.rollout.weights import adapter_weights, lora_rank, write_lora_adapter

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    lora = LoraConfig(r=4, lora_alpha=12, target_modules="all-linear", rank_pattern={"down_proj": 2})
    trained = get_peft_model(base, lora)
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # B starts at zero: give the adapter an effect to reproduce
    assert lora_rank(trained) == 4
    with adapter_weights(trained) as weights:
        nbytes = write_lora_adapter(weights, tmp_path / "v1")
    config = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4 and "q_proj" in config["target_modules"]
    assert nbytes == sum(p.numel() * 4 for n, p in trained.named_parameters() if "lora_" in n)

    fresh = LlamaForCausalLM(cfg)
    fresh.load_state_dict(state)
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "v1")
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want, got = trained(ids).logits, loaded(ids).logits
        with loaded.disable_adapter():
            bare = loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (bare - want).abs().max() > 1e-2  # the adapter is what made them agree
    with pytest.raises(ValueError, match="not part of a LoRA adapter"):
        write_lora_adapter([("model.embed_tokens.weight", torch.zeros(2))], tmp_path / "bad")


def test_vllm_gets_its_own_lora_for_adapter_pushes_with_a_rank_bound_it_takes():
    from plait.rollout.vllm_engine import lora_kwargs

    def kw(*sets, device="cuda"):
        return lora_kwargs(load_config(None, ["rollout.engine=vllm", *sets]), torch.device(device))

    assert kw() == {}  # no LoRA
    assert kw("model.lora={r: 4}")["max_lora_rank"] == 8  # vLLM's rank bounds: 1, 8, 16, 32, ...
    assert kw("model.lora={r: 16}") == dict(enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=2)
    assert kw("model.lora={r: 600}") == {}  # above vLLM's largest: merged weights
    assert kw("model.lora={r: 16}", "rollout.lora_push=merged") == {}
    assert kw("model.lora={r: 16}", device="cpu") == {}  # auto: vLLM's CPU LoRA ops are slow
    assert kw("model.lora={r: 16}", "rollout.lora_push=adapter", device="cpu")["enable_lora"]


def test_the_run_header_says_what_a_lora_run_pushes_to_each_engine():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.train.setup import lora_push_note

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules="all-linear"))

    def note(*sets, device="cpu"):
        return lora_push_note(load_config(None, ["model.lora={r: 4}", *sets]), model, torch.device(device))

    assert note() is None  # the in-process HF engine samples from the trainer's own model
    assert note("rollout.engine=vllm", device="cuda").startswith("LoRA: vLLM loads the adapter alone each round (")
    assert "vLLM's CPU LoRA ops sample several times slower" in note("rollout.engine=vllm")
    assert note("rollout.engine=vllm", "rollout.lora_push=adapter").startswith("LoRA: vLLM loads the adapter")
    server = ("rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.vllm.servers=[http://127.0.0.1:1]")
    assert "rollout servers get the adapter alone" in note(*server) and "merged weights otherwise" in note(*server)
    assert note("rollout.engine=vllm", "rollout.lora_push=merged") == (
        "LoRA: vLLM gets merged weights each round (rollout.lora_push=merged)"
    )
    assert "generation process gets the adapter alone" in note("rollout.generation_process=true")
    assert "above vLLM's largest LoRA rank" in lora_push_note(
        load_config(None, ["model.lora={r: 600}", "rollout.engine=vllm"]), model, torch.device("cuda")
    )


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
            "rollout.engine=vllm",
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
