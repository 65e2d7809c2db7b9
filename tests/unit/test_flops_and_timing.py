"""The telemetry's pieces: FLOPs model against torch's own FLOP counter, device peaks, phase
timing, memory, the end-of-run suggestion."""

import functools
import json
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from plait.config import load_config
from plait.models import load_model
from plait.telemetry import PhaseTimer, advice
from plait.telemetry.advice import suggestion
from plait.telemetry.flops import device_peak, gpu_peak, measure_cpu_peak, model_cost
from plait.telemetry.memory import MemoryMeter
from plait.train.metrics import phase_summary


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    model = load_model(str(tiny_model_path), "float32")
    n = sum(p.numel() for p in model.parameters())
    return model, model_cost(model.config, n, n)


def counted(model, lengths, backward=False):
    """FLOPs torch's FlopCounterMode sees for a forward (and backward) of each sequence."""
    total = 0
    for t in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, t))
        with FlopCounterMode(display=False) as fc:
            out = model(input_ids=ids).logits.float().sum()
            if backward:
                out.backward()
        total += fc.get_total_flops()
        model.zero_grad(set_to_none=True)
    return total


def test_forward_flops_match_torch_flop_counter(tiny):
    model, cost = tiny
    lengths = [17, 40]
    assert cost.forward(lengths) == pytest.approx(counted(model, lengths), rel=0.02)


def test_training_flops_match_torch_flop_counter(tiny):
    model, cost = tiny
    lengths = [24, 9]
    assert cost.train(lengths) == pytest.approx(counted(model, lengths, backward=True), rel=0.03)


def test_generation_flops_count_each_prompt_once(tiny):
    _, cost = tiny
    one = cost.generate([10], [[5]])
    two = cost.generate([10], [[5, 5]])
    n, h, layers, d = cost.matmul_params, cost.head_params, cost.layers, cost.attn_width
    prefill = 10 * (2 * (n - h) + 4 * layers * d * 10) + 2 * h  # the head only at the last prompt position
    decode = sum(2 * n + 4 * layers * d * (10 + i) for i in range(1, 5))  # tokens 1..4 fed back, each over prompt + i
    assert one == pytest.approx(prefill + decode)
    assert two - one == pytest.approx(decode)  # a second completion adds only its decode


def test_untied_input_embedding_is_a_lookup_not_a_matmul(tiny):
    model, _ = tiny
    cfg = model.config
    untied = type(cfg).from_dict({**cfg.to_dict(), "tie_word_embeddings": False})
    n = 10_000_000
    assert model_cost(untied, n, n).matmul_params == n - cfg.vocab_size * cfg.hidden_size
    lora = model_cost(cfg, n, 1000)
    assert lora.train([8]) < model_cost(cfg, n, n).train([8])  # frozen weights get no weight gradient


def test_device_peaks():
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert gpu_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert gpu_peak("Some Future GPU", "bf16") is None
    assert device_peak(torch.device("cpu"), "fp32", override=1e12) == (1e12, "log.peak_flops")
    peak, size = measure_cpu_peak(torch.float32, torch.get_num_threads(), sizes=(256, 512), repeats=2)
    assert 1e8 < peak < 1e14  # a real CPU, measured: between 0.1 GFLOP/s and 100 TFLOP/s
    assert size in (256, 512)


def test_the_peak_measurement_stops_growing_at_a_slow_matmul():
    """A matmul slower than the budget ends the growth (bf16 on a CPU without bf16 kernels
    would take minutes at 2048); a fast one goes on to the largest size."""
    threads = torch.get_num_threads()
    assert measure_cpu_peak(torch.float32, threads, sizes=(64, 128, 256), repeats=1, budget_s=0.0)[1] == 64
    assert measure_cpu_peak(torch.float32, threads, sizes=(64, 128, 256), repeats=1, budget_s=1e9)[1] == 256


def test_phases_and_idle_cover_the_step():
    timer = PhaseTimer()
    with timer("generate"):
        time.sleep(0.02)
    time.sleep(0.01)  # in no phase
    with timer("train"):
        time.sleep(0.03)
    times = timer.reset()
    assert times["time/generate"] >= 0.02 and times["time/train"] >= 0.03 and times["time/idle"] >= 0.01
    assert times["time/generate"] + times["time/train"] + times["time/idle"] == pytest.approx(times["time/step"])
    total, shares = phase_summary([{"step": 1, **times}, {"step": 2, **times}])
    assert total == pytest.approx(2 * times["time/step"]) and sum(shares.values()) == pytest.approx(1.0)


def test_memory_peak_is_per_step():
    meter = MemoryMeter(torch.device("cpu"))
    meter.take()
    big = torch.ones(
        256 * 2**20 // 4
    )  # 256 MiB, touched: well above what other threads of the test process may allocate
    first = meter.take()
    del big
    meter.take()  # this step began with the tensor still held
    third = meter.take()
    assert first["memory/peak_rss_gb"] - third["memory/peak_rss_gb"] > 0.2, (
        first,
        third,
    )  # the peak was reset after the steps that had it
    assert third["memory/rss_gb"] > 0


def test_suggestion_names_the_dominant_phase_and_the_settings(monkeypatch):
    cfg = load_config(None, ["rollout.max_completion_length=256", "rollout.num_generations=8"])
    tip = suggestion({"generate": 0.78, "train": 0.2, "score": 0.02}, cfg)
    assert tip.startswith("generate is 78% of step time") and "rollout.engine=vllm" in tip
    assert "max_completion_length (now 256)" in tip and "num_generations (now 8)" in tip
    fp32 = load_config(None, ["train.precision=fp32", "train.device=cpu"])
    for native in (True, False):  # bf16 is suggested on a CPU only where it multiplies bf16 natively
        monkeypatch.setattr(advice, "native_bf16_cpu", lambda: native)
        assert ("train.precision=bf16 (this CPU" in suggestion({"train": 0.6, "generate": 0.4}, fp32)) == native
        assert ("rollout.precision=bf16 (this CPU" in suggestion({"train": 0.4, "generate": 0.6}, fp32)) == native
    bf16 = load_config(None, ["rollout.precision=bf16", "train.device=cpu"])
    assert "rollout.precision=bf16" not in suggestion({"train": 0.4, "generate": 0.6}, bf16)  # already
    assert suggestion({"train": 0.45, "generate": 0.45, "idle": 0.1}, cfg) is None  # nothing dominates


def test_shared_prompt_pass_flops_match_the_group_cost_model(tiny):
    """A group's prompt run once, its KV cache shared by 4 completions: what torch counts for
    that forward+backward is what the cost model charges a group (and less than 4 whole rows),
    plus the prompt's last token, which each completion feeds itself (n - 1 extra tokens)."""
    from plait.algo.logprobs import shared_prompt_logprobs

    model, cost = tiny
    p, c, n = 14, 10, 4
    ids = torch.randint(0, model.config.vocab_size, (n, p + c))
    ids[:, :p] = ids[0, :p]
    mask = torch.ones_like(ids)
    with FlopCounterMode(display=False) as fc:
        shared_prompt_logprobs(model, ids, mask, p, [n]).sum().backward()
    model.zero_grad(set_to_none=True)
    extra = (n - 1) * 6 * (cost.matmul_params - cost.head_params)
    assert cost.train_groups([p], [[c] * n]) + extra == pytest.approx(fc.get_total_flops(), rel=0.03)
    assert cost.train_groups([p], [[c] * n]) < 0.8 * cost.train([p + c] * n)


def _assert_same_as_the_padded_pass(model, ids, mask, p, runs, fn):
    """`fn`'s completion log-probs, entropies and their gradients are the padded pass's."""
    from plait.algo.logprobs import completion_logprobs

    real = mask[:, p:].bool()
    plain, plain_ent = completion_logprobs(model, ids, mask, p, temperature=0.7, with_entropy=True)
    shared, shared_ent = fn(model, ids, mask, p, runs, temperature=0.7, with_entropy=True)
    torch.testing.assert_close(shared[real], plain[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared_ent[real], plain_ent[real], rtol=1e-5, atol=1e-5)
    params = [q for q in model.parameters() if q.requires_grad]
    g_plain = torch.autograd.grad((plain * real).sum(), params)
    g_shared = torch.autograd.grad((shared * real).sum(), params)
    for a, b in zip(g_plain, g_shared):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("way", ["shared_cache", "packed", "packed_forward"])
def test_shared_prompt_pass_gives_the_plain_log_probs_and_gradients(tiny, way):
    """Two groups with prompts of different lengths (left padding) and ragged completions:
    sharing each prompt's pass (a KV cache handed on, or each group packed into one row, through
    the decoder and head apart or through the model's own forward as DDP/FSDP2/ZeRO need)
    changes nothing but float rounding, forward and backward, entropies included."""
    from plait.algo.logprobs import packed_group_logprobs, prompt_runs, shared_prompt_logprobs

    model, _ = tiny
    torch.manual_seed(1)
    p, c = 12, 9
    ids = torch.randint(5, 1000, (7, p + c))
    mask = torch.ones_like(ids)
    ids[:4, :p] = ids[0, :p]
    ids[4:, :p] = ids[4, :p]
    ids[4:, :3], mask[4:, :3] = 0, 0  # the second prompt is shorter
    mask[1, p + 5 :], mask[6, p + 2 :] = 0, 0  # completions end early
    runs = prompt_runs(ids, mask, p)
    assert runs == [4, 3]
    fn = {
        "shared_cache": shared_prompt_logprobs,
        "packed": packed_group_logprobs,
        "packed_forward": functools.partial(packed_group_logprobs, through_forward=True),
    }[way]
    _assert_same_as_the_padded_pass(model, ids, mask, p, runs, fn)


@pytest.mark.parametrize("through_forward", [False, True])
def test_groups_whose_prompts_share_a_beginning_pack_it_once_and_give_the_plain_log_probs(tiny, through_forward):
    """Three groups whose prompts begin alike (a system prompt, worked examples) and differ after
    it, in length too: packed into one row holding that beginning once, every completion token's
    log-prob, entropy and gradient are the plain padded pass's to float rounding; prompts that
    share nothing keep a row per group."""
    from plait.algo.logprobs import pack_groups, packed_group_logprobs, prompt_runs

    model, _ = tiny
    torch.manual_seed(2)
    p, c, head = 44, 6, 36
    ids = torch.randint(5, 1000, (7, p + c))
    mask = torch.ones_like(ids)
    for rows, pad in ((slice(0, 3), 0), (slice(3, 5), 0), (slice(5, 7), 2)):
        first = rows.start
        ids[rows, :p] = ids[first, :p]
        ids[rows, :pad], mask[rows, :pad] = 0, 0  # the third prompt is 2 tokens shorter
    beginning = torch.randint(5, 1000, (head,))
    ids[:5, :head] = beginning
    ids[5:, 2 : 2 + head] = beginning
    mask[1, p + 4 :], mask[6, p + 2 :] = 0, 0  # completions end early
    runs = prompt_runs(ids, mask, p)
    assert runs == [3, 2, 2]
    packed = pack_groups(ids, mask, p, runs, hidden_size=model.config.hidden_size)
    assert packed.input_ids.shape[0] == 1  # one row: the beginning once
    prompts = sum(int(mask[r, :p].sum()) for r in (0, 3, 5))
    assert packed.input_ids.shape[1] == prompts - 2 * head + int(mask[:, p:].sum())
    unshared = ids.clone()
    unshared[3:5, :head] = torch.randint(5, 1000, (head,))  # the second group now shares nothing
    unshared[5:, 2] += 1
    assert (
        pack_groups(unshared, mask, p, prompt_runs(unshared, mask, p), model.config.hidden_size).input_ids.shape[0] == 3
    )

    _assert_same_as_the_padded_pass(
        model, ids, mask, p, runs, functools.partial(packed_group_logprobs, through_forward=through_forward)
    )


@pytest.mark.parametrize("tied", [True, False])
def test_decode_roofline_counts_what_a_decode_step_reads_and_computes(tiny_model_path, tied):
    """The bound's inputs against the real thing: the KV bytes are the cache's own tensors after
    `context` positions, the weights are every parameter a step multiplies (an untied input
    embedding only gathers rows), the FLOPs are what torch's counter sees for one decode step."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from plait.telemetry.bandwidth import decode_cost, gpu_bandwidth

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, tie_word_embeddings=tied)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    cost = decode_cost(model)
    rows, context = 3, 21
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 1000, (rows, context - 1)), past_key_values=cache, use_cache=True)
        with FlopCounterMode(display=False) as fc:
            model(input_ids=torch.randint(0, 1000, (rows, 1)), past_key_values=cache, use_cache=True)
    kv = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert rows * context * cost.kv_bytes_per_position == kv
    embedding = model.model.embed_tokens.weight
    all_params = {p.data_ptr(): p for p in model.parameters()}.values()
    expected = sum(p.nbytes for p in all_params) - (0 if tied else embedding.nbytes)
    assert cost.weight_bytes == expected
    assert cost.flops(rows, context) == pytest.approx(fc.get_total_flops(), rel=0.02)
    seconds, kind = cost.bound(rows, context, bandwidth=1e9, peak=1e15)
    assert kind == "memory" and seconds == pytest.approx(cost.bytes(rows, context) / 1e9)
    assert cost.bound(rows, context, bandwidth=1e15, peak=1e9)[1] == "compute"
    assert gpu_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and gpu_bandwidth("NVIDIA H100 PCIe") == 2.0e12


def test_the_measured_cpu_peak_is_cached_per_kernel_cap(tmp_path, monkeypatch):
    """A run under train.deterministic's caps (MKL's reproducible branch runs a matmul several
    times slower) must not leave its peak as the CPU's: the caps are part of the cache key."""
    from plait.telemetry import flops

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in flops.KERNEL_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    measured = []
    monkeypatch.setattr(
        flops, "measure_cpu_peak", lambda dtype, threads: (measured.append(1) or 1e9 * len(measured), 2048)
    )
    plain = flops.cpu_peak("fp32")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE,STRICT")
    capped = flops.cpu_peak("fp32")
    monkeypatch.delenv("MKL_CBWR")
    assert (plain, capped, flops.cpu_peak("fp32")) == (1e9, 2e9, 1e9)  # measured twice, the plain one reread
    keys = json.loads((tmp_path / "plait" / "peak_flops.json").read_text())
    assert len(keys) == 2 and any("MKL_CBWR=COMPATIBLE,STRICT" in k for k in keys)
