import pytest
import torch

from plait.algo.logprobs import completion_logprobs
from plait.models import load_model, load_tokenizer
from plait.rollout.hf import HFEngine
from plait.train.batch import collate
from plait.types import Group, Prompt, SamplingParams


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path))
    texts = ["What is 2 + 2?", "Name a colour that is a longer prompt than the first one.", "Hi"]
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(texts)]
    return tok, model, prompts


def test_greedy_matches_transformers_generate(setup):
    tok, model, prompts = setup
    engine = HFEngine(model, tok, batch_size=8)
    ours = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0), n=1)
    for p, (c,) in zip(prompts, ours):
        ref = model.generate(
            torch.tensor([p.token_ids]), max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id
        )
        expected = ref[0, len(p.token_ids) :].tolist()
        assert c.truncated == (c.finish_reason == "length") and len(c.token_ids) <= 10
        if c.finish_reason == "length":
            assert c.token_ids == expected  # all 10 tokens, the same
        else:  # ours stopped at EOS: so did generate(), which pads after it
            n = len(c.token_ids)
            assert c.token_ids == expected[:n] and tok.eos_token_id in expected[n - 1 : n + 1], (c.token_ids, expected)


def test_groups_seeds_and_batching(setup):
    tok, model, prompts = setup
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    a = HFEngine(model, tok, batch_size=64).generate(prompts, params, n=4)
    assert [len(g) for g in a] == [4, 4, 4]
    assert all(c.prompt_index == i for i, g in enumerate(a) for c in g)
    b = HFEngine(model, tok, batch_size=64).generate(prompts, params, n=4)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]  # same seed, same draws
    other = HFEngine(model, tok, batch_size=64).generate(prompts, SamplingParams(8, 1.0, seed=6), n=4)
    assert [[c.token_ids for c in g] for g in a] != [[c.token_ids for c in g] for g in other]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1  # a group's completions differ
    # greedy results don't depend on how prompts are batched
    g1 = HFEngine(model, tok, batch_size=1).generate(prompts, SamplingParams(8, 0.0), n=2)
    g2 = HFEngine(model, tok, batch_size=64).generate(prompts, SamplingParams(8, 0.0), n=2)
    assert [[c.token_ids for c in g] for g in g1] == [[c.token_ids for c in g] for g in g2]


def test_a_groups_samples_do_not_depend_on_its_batch_mates(setup):
    """Per-group random streams: a prompt sampled alone, with others, or in another batch
    split gets the same completions (this is what lets N processes match one)."""
    tok, model, prompts = setup
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    together = HFEngine(model, tok, batch_size=64).generate(prompts, params, n=3)
    alone = [HFEngine(model, tok).generate([p], params, n=3)[0] for p in prompts]
    reversed_ = HFEngine(model, tok, batch_size=3).generate(prompts[::-1], params, n=3)[::-1]
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    assert ids(together) == ids(alone) == ids(reversed_)


def test_engine_logprobs_equal_the_trainers(setup):
    tok, model, prompts = setup
    out = HFEngine(model, tok).generate(prompts, SamplingParams(max_tokens=8, temperature=0.7, seed=1), n=2)
    groups = [Group(p, cs) for p, cs in zip(prompts, out)]
    batch = collate(groups, tok.pad_token_id)
    with torch.no_grad():
        trainer = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature=0.7)
    mask = batch.completion_mask.bool()
    assert torch.allclose(trainer[mask], batch.sampling_logprobs[mask], atol=1e-4)


def test_stop_strings_and_top_k_top_p(setup):
    tok, model, prompts = setup
    engine = HFEngine(model, tok)
    ((full,),) = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0), n=1)
    assert len(full.text) > 6
    stop = full.text[3:6]
    ((cut,),) = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0, stop=[stop]), n=1)
    assert cut.finish_reason == "stop" and cut.text.endswith(stop) and not cut.truncated
    assert len(cut.token_ids) < len(full.token_ids) and cut.token_ids == full.token_ids[: len(cut.token_ids)]
    # top_k=1 is greedy whatever the temperature
    ((k1,),) = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3), n=1)
    assert k1.token_ids == full.token_ids
    ((p0,),) = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3), n=1)
    assert p0.token_ids == full.token_ids
