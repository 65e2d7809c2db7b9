"""The static decoding steps that CUDA graphs capture (rollout/graphs.py), run uncaptured on the
CPU: the same tokens and log-probs as the eager engine. tests/gpu/test_cuda.py runs them
captured on a GPU."""

from __future__ import annotations

import pytest
import torch

from plait.rollout import graphs
from plait.rollout.graphs import StaticDecoder
from plait.rollout.hf import HFEngine
from plait.types import Prompt, SamplingParams


def test_buckets_round_rows_to_powers_of_two_within_the_batch_and_lengths_to_128():
    assert [graphs.bucket_rows(r, 64) for r in (1, 2, 3, 8, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert graphs.bucket_rows(40, 48) == 48 and graphs.bucket_rows(70, 64) == 70  # never below the rows
    assert [graphs.bucket_length(t) for t in (1, 128, 129, 300)] == [128, 128, 256, 384]


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def _logprobs(groups):
    return torch.tensor([x for g in groups for c in g for x in c.logprobs])


@pytest.fixture(scope="module")
def engine_and_prompts(tiny_model_path):
    from plait.models import load_model, load_tokenizer

    tok, model = load_tokenizer(str(tiny_model_path)), load_model(str(tiny_model_path))
    texts = ["What is 2 + 2?", "Name a colour, please, and say why you like it.", "Hi"]
    return model, tok, [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(texts)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_steps_sample_what_the_eager_engine_does(engine_and_prompts, temperature):
    """Prompts of several lengths (left padding), 12 rows in a 16-row bucket (4 idle rows), rows
    finishing at different steps and staying in their slots: the same tokens, log-probs within
    1e-4; a second call of the same shape reuses the bucket and its stale columns leak nothing."""
    model, tok, prompts = engine_and_prompts
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=5)
    eager, static = HFEngine(model, tok), HFEngine(model, tok)
    static.static = StaticDecoder(capture=False)
    for engine in (eager, static):
        engine.eos_ids = list(range(0, len(tok), 9))  # about one token in 9 ends a row
    theirs = eager.generate(prompts, params, n=4)
    for seed in (5, 5, 6):
        params.seed = seed
        ours = static.generate(prompts, params, n=4)
        if seed == 6:
            theirs = eager.generate(prompts, params, n=4)
        assert _tokens(ours) == _tokens(theirs)
        assert torch.allclose(_logprobs(ours), _logprobs(theirs), atol=1e-4)
    assert list(static.static.buckets) == [(16, 128, torch.float32, "fp32")]
    if temperature:
        assert len({len(c.token_ids) for g in ours for c in g}) > 2  # rows ended at several steps
    assert static.stats() == {}  # nothing captured, nothing to report


def test_weights_updated_in_place_are_what_the_next_call_samples(engine_and_prompts):
    import copy

    model, tok, prompts = engine_and_prompts
    model = copy.deepcopy(model)
    params = SamplingParams(max_tokens=10, temperature=0, seed=1)
    static = HFEngine(model, tok)
    static.static = StaticDecoder(capture=False)
    before = static.generate(prompts, params, n=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # as an optimizer step does: the same tensors
    after = static.generate(prompts, params, n=2)
    assert _tokens(after) == _tokens(HFEngine(model, tok).generate(prompts, params, n=2))
    assert _tokens(after) != _tokens(before)


def test_sliding_window_models_decode_eagerly(tiny_model_path, engine_and_prompts):
    from transformers import AutoModelForCausalLM, MistralConfig

    _, tok, prompts = engine_and_prompts
    config = MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    static = HFEngine(model, tok)
    static.static = StaticDecoder(capture=False)
    assert _tokens(static.generate(prompts, params, n=2)) == _tokens(
        HFEngine(model, tok).generate(prompts, params, n=2)
    )
    assert static.static.buckets == {}  # one mask can't serve a window: not even tried
