"""The CPU fast paths behind plait's step time: the inverse-CDF sampler, oneDNN-packed decoding
weights, int8 and bf16 rollouts, grouped decoding attention, shared-prefix decoding, and retained
host memory. Each must give what the slow path gives (int8 and bf16: within their rounding)."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from plait.rollout.hf import HFEngine, inverse_cdf, sample_next
from plait.rollout.packed import (
    Bf16Copies,
    bf16_linears,
    bf16_packing_available,
    int8_available,
    int8_linears,
    packed_linears,
    packing_available,
)
from plait.train.hostmem import glibc
from plait.types import Prompt, SamplingParams


def test_inverse_cdf_draws_follow_the_distribution():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]]).expand(200_000, -1)
    u = torch.rand(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    draws = inverse_cdf(probs, u)
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    assert freq[[0, 2, 5]].sum() == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs[0].double(), atol=0.005)
    # the ends of [0, 1) map to the first and the last token with mass
    edges = inverse_cdf(probs[:2], torch.tensor([0.0, 1.0 - 1e-12], dtype=torch.float64))
    assert edges.tolist() == [1, 4]


def test_sampling_respects_top_k_and_uses_each_groups_stream():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=3, seed=0)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 100)]
        token, logp = sample_next(logits, params, gens, groups)
        top3 = logits.topk(3).indices
        assert all(t in top3[i] for i, t in enumerate(token.tolist()))
        assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1))
    # group 1's draws don't depend on group 0's stream
    a, _ = sample_next(logits, params, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(7)], groups)
    b, _ = sample_next(logits, params, [torch.Generator().manual_seed(2), torch.Generator().manual_seed(7)], groups)
    assert a[3:].tolist() == b[3:].tolist()


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed linear")
def test_packed_linears_compute_the_same_and_restore_the_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32, bias=False))
    half = torch.nn.Linear(8, 8).to(torch.bfloat16)
    model.append(torch.nn.Identity())
    x = torch.randn(5, 7, 64)
    with torch.no_grad():
        expected = model(x)
        with packed_linears(model) as n, packed_linears(model) as nested:
            assert (n, nested) == (2, 0)  # nested use leaves the outer packing alone
            assert all("forward" in m.__dict__ for m in model if isinstance(m, torch.nn.Linear))
            got = model(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):  # falls back to torch's own linear
                assert model(x).dtype == torch.bfloat16
        with packed_linears(half) as skipped:
            assert skipped == 0  # only fp32 weights are packed
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert not any("forward" in m.__dict__ for m in model)  # restored
    model(x).sum().backward()  # and trainable again
    assert model[0].weight.grad is not None


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed linear")
def test_engine_samples_the_same_with_packed_weights(tiny_model_path):
    from plait.models import load_model, load_tokenizer

    tok, model = load_tokenizer(str(tiny_model_path)), load_model(str(tiny_model_path))
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour."])]
    greedy, sampled = (
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3),
    )
    for params in (greedy, sampled):
        plain = HFEngine(model, tok, packed_weights=False).generate(prompts, params, n=3)
        packed = HFEngine(model, tok, packed_weights=True).generate(prompts, params, n=3)
        assert [[c.token_ids for c in g] for g in plain] == [[c.token_ids for c in g] for g in packed]
        for gp, gq in zip(plain, packed):
            for cp, cq in zip(gp, gq):
                assert torch.allclose(torch.tensor(cp.logprobs), torch.tensor(cq.logprobs), atol=1e-4)


def test_fused_norms_swap_llama_form_norms_only_and_sample_the_same(tiny_model_path):
    """rollout/fused.py: every Llama-form RMSNorm (2 per layer and the last) runs torch's fused
    one, with the same logits to float rounding, in fp32 and bf16; a norm of another form
    (Gemma's 1 + weight) is left alone; the engine samples the same tokens with it on or off."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from plait.models import load_model, load_tokenizer
    from plait.rollout.fused import fused_norms

    tok, model = load_tokenizer(str(tiny_model_path)), load_model(str(tiny_model_path))
    ids = torch.tensor([tok("What is 2 + 2? Name a colour.")["input_ids"]])
    layers = model.config.num_hidden_layers
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        m = copy.deepcopy(model).to(dtype)
        with torch.no_grad():
            expected = m(ids).logits
            with fused_norms(m) as n:
                assert n == 2 * layers + 1
                got = m(ids).logits
        assert got.dtype == dtype and torch.allclose(got.float(), expected.float(), atol=atol), (
            (got - expected).abs().max()
        )
        assert not any("forward" in mod.__dict__ for mod in m.modules())  # restored
    x = torch.randn(3, 16)
    norms = torch.nn.ModuleList([LlamaRMSNorm(16), GemmaRMSNorm(16)])
    with torch.no_grad():
        torch.nn.init.normal_(norms[0].weight)
        with fused_norms(norms) as n:
            assert n == 1 and "forward" not in norms[1].__dict__
            assert torch.allclose(norms[0](x), LlamaRMSNorm.forward(norms[0], x), atol=1e-6)

    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour."])]
    for params in (SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, seed=3)):
        plain = HFEngine(model, tok, fused_norms=False).generate(prompts, params, n=3)
        fused = HFEngine(model, tok).generate(prompts, params, n=3)
        assert [[c.token_ids for c in g] for g in plain] == [[c.token_ids for c in g] for g in fused]
        lp = [torch.tensor(c.logprobs) for g in plain for c in g]
        lq = [torch.tensor(c.logprobs) for g in fused for c in g]
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(lp, lq))


class _HeadedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 64, bias=False))
        self.head = torch.nn.Linear(64, 50, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(self.body(x))


def test_bf16_copies_give_autocasts_products_and_follow_the_weights_in_place():
    """Bf16Copies (a GPU's bf16 rollouts, here on the CPU's autocast): the same numbers as
    autocast rounding each weight itself, the copies at fixed addresses across calls and after
    an in-place update, the modules restored on exit."""
    torch.manual_seed(0)
    model, copies = _HeadedModel(), Bf16Copies()
    x = torch.randn(5, 7, 64)

    def autocast():  # without its cache of casts, which would keep weights changed in place stale
        return torch.autocast("cpu", torch.bfloat16, cache_enabled=False)

    with torch.no_grad():
        for _ in range(2):
            with autocast():
                expected = model(x)
            with copies.linears(model) as n, autocast():
                assert n == 3
                got = model(x)
            assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
            addresses = [c.data_ptr() for c in copies.copies.values()]
            for p in model.parameters():
                p.add_(torch.randn_like(p))  # the optimizer's step: in place
        with copies.linears(model), autocast():
            for p in model.parameters():
                p.mul_(-1.0)  # mid-call (an in-flight update): refresh() brings the copies along
            copies.refresh()
            got = model(x)
        assert [c.data_ptr() for c in copies.copies.values()] == addresses
        with autocast():
            assert torch.equal(got, model(x))
        assert not any("forward" in m.__dict__ for m in model.modules())  # restored
        fp32 = model(x)
        with copies.linears(model):
            assert torch.equal(model(x), fp32)  # without autocast: the fp32 weights


@pytest.mark.skipif(not int8_available(), reason="this torch has no fbgemm int8 kernels")
def test_int8_linears_stay_near_fp32_keep_the_head_and_restore_the_model():
    torch.manual_seed(0)
    model = _HeadedModel()
    x = torch.randn(5, 7, 64)
    with torch.no_grad():
        expected, body = model(x), model.body(x)
        with int8_linears(model) as n:
            assert n == 2 and "forward" not in model.head.__dict__  # the output head stays fp32
            got, got_body = model(x), model.body(x)
            with packed_linears(model) as rest:
                assert rest == 1  # what the engine packs in fp32 inside: the head alone
    relative = float((got_body - body).norm() / body.norm())
    assert 1e-5 < relative < 0.03  # int8 rounding: not the fp32 numbers, but near them
    assert float((got - expected).norm() / expected.norm()) < 0.03
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored
    model(x).sum().backward()
    assert model.body[0].weight.grad is not None


@pytest.mark.skipif(not bf16_packing_available(), reason="this CPU or torch cannot pack bf16 weights")
def test_bf16_linears_multiply_bf16_rounded_numbers_in_fp32_and_restore_the_model():
    torch.manual_seed(0)
    model = _HeadedModel()
    x = torch.randn(5, 7, 64)

    def rounded(layer, x):  # bf16 inputs and weights, fp32 sums, the product rounded to bf16, fp32 bias
        w = layer.weight.detach().bfloat16().float()
        out = torch.nn.functional.linear(x.bfloat16().float(), w).bfloat16().float()
        return out if layer.bias is None else out + layer.bias

    with torch.no_grad():
        expected = model(x)
        bf16 = rounded(model.head, rounded(model.body[2], torch.nn.functional.silu(rounded(model.body[0], x))))
        with bf16_linears(model) as n:
            assert n == 3  # the head too
            got = model(x)
    assert got.dtype == torch.float32 and torch.allclose(got, bf16, atol=1e-6, rtol=1e-2)  # one bf16 step
    assert 1e-4 < float((got - expected).norm() / expected.norm()) < 0.02  # bf16 rounding, not fp32
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored
    model(x).sum().backward()
    assert model.body[0].weight.grad is not None
    half = copy.deepcopy(model).bfloat16()  # as the generation process loads it for bf16 rollouts
    with torch.no_grad(), bf16_linears(half) as n:
        assert n == 3
        out = half(x.bfloat16())
    assert out.dtype == torch.bfloat16 and float((out.float() - expected).norm() / expected.norm()) < 0.03


_NATIVE = {"int8": int8_available(), "bf16": bf16_packing_available()}


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_engine_samples_at_low_precision_near_the_trainers_policy(tiny_model_path, precision, monkeypatch):
    import plait.rollout.hf as hf
    from plait.models import load_model, load_tokenizer

    if not _NATIVE[precision]:
        pytest.skip(f"this CPU or torch has no packed {precision} kernels")
    real = hf.autocast
    monkeypatch.setattr(
        hf, "autocast", lambda device, p, **kw: pytest.fail("bf16 autocast") if p == "bf16" else real(device, p, **kw)
    )
    tok, model = load_tokenizer(str(tiny_model_path)), load_model(str(tiny_model_path))
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour."])]
    engine = HFEngine(model, tok, precision=precision)
    groups = engine.generate(prompts, SamplingParams(max_tokens=12, seed=3), n=3)
    gaps = []
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            for c in group:
                ids = torch.tensor([prompt.token_ids + c.token_ids])
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                ours = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(prompt.token_ids) - 1 :]
                gaps.append((ours - torch.tensor(c.logprobs)).abs())
    gap = torch.cat(gaps)
    assert len(gap) == 2 * 3 * 12 and 1e-5 < float(gap.mean()) < 0.05  # sampled in low precision, near fp32
    assert not any("forward" in m.__dict__ for m in model.modules())  # the trainer's module is left as it was
    greedy = SamplingParams(max_tokens=12, temperature=0)
    with hf.decoding_in("fp32"):  # how evaluation decodes: in the trainer's precision
        evaluated = engine.generate(prompts, greedy, n=1)
    fp32 = HFEngine(model, tok).generate(prompts, greedy, n=1)
    assert [c.logprobs for g in evaluated for c in g] == [c.logprobs for g in fp32 for c in g]
    assert [c.logprobs for g in engine.generate(prompts, greedy, n=1) for c in g] != [
        c.logprobs for g in fp32 for c in g
    ]


def test_grouped_decoding_attention_equals_sdpa_and_samples_the_same(tiny_model_path, monkeypatch):
    import contextlib

    import plait.rollout.hf as hf
    from plait.models import load_model, load_tokenizer
    from plait.rollout.packed import grouped_attention, grouped_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups = 3

    torch.manual_seed(0)
    q, k, v = torch.randn(5, 6, 1, 16), torch.randn(5, 2, 9, 16), torch.randn(5, 2, 9, 16)
    mask = torch.ones(5, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :4] = mask[3, ..., :7] = False  # left padding
    ours, _ = grouped_attention_forward(Attention(), q, k, v, mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask
    ).transpose(1, 2)
    assert ours.shape == (5, 1, 6, 16) and torch.allclose(ours, theirs, atol=1e-5)

    tok, model = load_tokenizer(str(tiny_model_path)), load_model(str(tiny_model_path))
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny model shares heads
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour, please."])]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    grouped = HFEngine(model, tok).generate(prompts, params, n=3)
    monkeypatch.setattr(hf, "grouped_attention", lambda model: contextlib.nullcontext())
    plain = HFEngine(model, tok).generate(prompts, params, n=3)
    assert [[c.token_ids for c in g] for g in plain] == [[c.token_ids for c in g] for g in grouped]
    lp = [torch.tensor([x for g in gs for c in g for x in c.logprobs]) for gs in (plain, grouped)]
    assert torch.allclose(*lp, atol=1e-4) and not torch.equal(*lp)  # another kernel, the same policy
    with pytest.raises(RuntimeError), grouped_attention(model):
        assert model.config._attn_implementation != "sdpa"
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"  # the trainer's attention is left as it was


def _random_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_shared_prefix_decoding_equals_the_copying_cache(tiny_model_path, monkeypatch):
    """A group's rows decode over one copy of their prompt's keys and values (rollout/prefix.py):
    the same tokens and log-probs within 1e-4 as transformers' copying cache, for shared and
    unshared key/value heads and biased projections, with prompts of several lengths and rows
    finishing at different steps; sliding-window models keep the copying cache."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    import plait.rollout.prefix as prefix
    from plait.models import load_model, load_tokenizer

    tok = load_tokenizer(str(tiny_model_path))
    small = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    models = {
        "llama, shared heads": load_model(str(tiny_model_path)),
        "llama, one kv head per query head": _random_model(
            LlamaConfig(**small, num_attention_heads=4, num_key_value_heads=4)
        ),
        "qwen2, biased qkv": _random_model(Qwen2Config(**small, num_attention_heads=4, num_key_value_heads=2)),
    }
    texts = ["What is 2 + 2?", "Name a colour, please, and say why you like it.", "Hi"]
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(texts)]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5)
    shared = []
    share = prefix.share_prefix
    monkeypatch.setattr(prefix, "share_prefix", lambda *a: shared.append(share(*a)) or shared[-1])
    for name, model in models.items():
        assert model.config.model_type in name
        engine = HFEngine(model, tok)
        engine.eos_ids = list(range(0, len(tok), 9))  # about one token in 9 ends a row: rows finish apart
        ours = engine.generate(prompts, params, n=4)
        assert shared.pop() is True, name
        with monkeypatch.context() as m:
            m.setattr(prefix, "share_prefix", lambda *a: False)
            theirs = engine.generate(prompts, params, n=4)
        assert [[c.token_ids for c in g] for g in ours] == [[c.token_ids for c in g] for g in theirs], name
        lengths = {len(c.token_ids) for g in ours for c in g}
        assert len(lengths) > 2, name  # rows left the batch at several steps
        lp = [torch.tensor([x for g in gs for c in g for x in c.logprobs]) for gs in (ours, theirs)]
        assert torch.allclose(*lp, atol=1e-4), name

    sliding = [
        MistralConfig(**small, num_attention_heads=4, num_key_value_heads=2, sliding_window=4),
        Qwen2Config(
            **small,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=0,
        ),
    ]
    for config in sliding:
        assert not prefix.full_attention_only(config)
        HFEngine(_random_model(config), tok).generate(prompts[:1], params, n=2)
        assert shared == [], config.model_type  # not even tried


def test_prompts_that_begin_alike_prefill_their_beginning_once_and_sample_the_same(tiny_model_path, monkeypatch):
    """Prompts sharing a long beginning (a system prompt, worked examples): the engine prefills it
    once and every prompt's rest reads its keys and values; the tokens are the ones sampled with
    every prompt prefilled whole, and the ones each prompt gets alone (no beginning to share), the
    log-probs within 1e-4."""
    import plait.rollout.hf as hf
    from plait.models import load_model, load_tokenizer

    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path))
    system = "You are a careful assistant. Answer with one number in a box. " * 4
    texts = [system + q for q in ("What is 2 + 2?", "What is 17 + 25, please?", "And 3 + 4?")]
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(texts)]
    assert hf.common_prefix([p.token_ids for p in prompts]) * 2 >= hf.MIN_SHARED_TOKENS
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k))
    ours = HFEngine(model, tok).generate(prompts, params, n=3)
    assert calls[0][0] == 1 and calls[1][0] == 3  # the beginning once, then the three rests
    with monkeypatch.context() as m:
        m.setattr(hf, "MIN_SHARED_TOKENS", 10**9)
        calls.clear()
        whole = HFEngine(model, tok).generate(prompts, params, n=3)
        assert calls[0][0] == 3
    alone = [HFEngine(model, tok).generate([p], params, n=3)[0] for p in prompts]
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    assert ids(ours) == ids(whole) == ids(alone)
    lp = [torch.tensor([x for g in gs for c in g for x in c.logprobs]) for gs in (ours, whole, alone)]
    assert torch.allclose(lp[0], lp[1], atol=1e-4) and torch.allclose(lp[0], lp[2], atol=1e-4)


# PR_SET_THP_DISABLE: page faults counted in 4 KiB pages whatever the machine's transparent huge
# pages mode (under `always` a fresh 64 MiB block faults in 2 MiB pages, 32 faults instead of 16384)
_FAULTS = textwrap.dedent("""
    import ctypes, resource, sys, torch
    from plait.train.hostmem import retained_host_memory
    assert ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0) == 0, ctypes.get_errno()
    def faults_of(size):  # page faults of allocating, touching and freeing `size` bytes
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.zeros(size // 4).add_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    with retained_host_memory(sys.argv[1] == "on") as active:
        print(int(active), *[faults_of(64 * 2**20) for _ in range(16)])
""")


@pytest.mark.skipif(glibc() is None, reason="glibc only")
def test_retained_host_memory_reuses_freed_blocks_without_page_faults():
    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True
        ).stdout.split()
        return int(out[0]), [int(x) for x in out[1:]]

    pages = 64 * 2**20 // 4096
    active, faults = run(
        "on"
    )  # the heap grows a few times around small allocations, then a freed block is reused as it is
    assert active == 1 and max(faults[-4:]) < pages // 20, faults
    active, faults = run("off")  # glibc's default: unmapped on free, faulted in again page by page every time
    assert active == 0 and min(faults) > pages // 2, faults
