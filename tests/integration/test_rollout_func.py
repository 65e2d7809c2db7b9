"""Your own rollout loop (`rollout.rollout_func`, plait/programs/rollout_func.py, tests/helpers/rollout_funcs.py)
on the tiny model: its generate samples what plait's engine samples, what it returns is trained on
token for token with its env_mask, its own fields reach the rewards, a malformed return is refused
with the key and the fix, and a real run trains through it."""

from __future__ import annotations

import pytest
from test_train import tiny_overrides

from plait.config import load_config
from plait.config.checks import check_user_loops, probe
from plait.data import build_prompts, load_rows
from plait.models import load_model, load_tokenizer
from plait.programs import ProgramSetup, make_program
from plait.programs.rollout_func import RolloutFuncError
from plait.rollout import make_engine
from plait.train.loop import train
from plait.types import SamplingParams


@pytest.fixture(scope="module")
def engine_and_prompts(tiny_model_path, prompts_jsonl):
    cfg = load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, "/unused"))
    tok = load_tokenizer(str(tiny_model_path))
    engine = make_engine(cfg, load_model(str(tiny_model_path), "float32"), tok)
    prompts = build_prompts(load_rows(cfg.data, "train")[:2], tok, cfg.data)
    return cfg, tok, engine, prompts


def hooked(cfg, tok, fn):
    """The rollout program of a run whose rollout.rollout_func is rollout_funcs:`fn`."""
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.rollout_func = f"rollout_funcs:{fn}"
    return make_program(ProgramSetup(cfg, tok))


def test_the_loop_samples_with_plaits_engine_and_returns_its_tokens_with_their_mask(engine_and_prompts):
    from rollout_funcs import FEEDBACK

    cfg, tok, engine, prompts = engine_and_prompts
    params = SamplingParams(max_tokens=30, seed=5)
    out = hooked(cfg, tok, "two_turns").run(engine, prompts, params, 2)
    plain = engine.generate(prompts, SamplingParams(max_tokens=10, seed=5), n=2)  # the first turn, without the hook
    line = tok(FEEDBACK, add_special_tokens=False)["input_ids"]
    assert [len(row) for row in out] == [2, 2]
    for row, plain_row in zip(out, plain):
        for c, p in zip(row, plain_row):
            first = len(p.token_ids)
            assert c.token_ids[:first] == p.token_ids and c.logprobs[:first] == p.logprobs
            assert c.token_ids[first : first + len(line)] == line  # the loop's line, as returned
            assert c.sampled_mask == [1] * first + [0] * len(line) + [1] * (len(c.token_ids) - first - len(line))
            assert c.columns == {"turns": 2} and len(c.token_ids) <= 30


def test_rewards_read_the_tokens_the_model_sampled_not_the_loops_own(engine_and_prompts):
    """two_turns adds a line of its own (env_mask 0) between the model's two answers: the text
    rewards read leaves it out (a line break in its place); the transcript keeps it."""
    from rollout_funcs import FEEDBACK

    from plait.rewards.runner import reward_inputs
    from plait.types import Group

    cfg, tok, engine, prompts = engine_and_prompts
    out = hooked(cfg, tok, "two_turns").run(engine, prompts, SamplingParams(max_tokens=30, seed=5), 2)
    inputs = reward_inputs([Group(p, row) for p, row in zip(prompts, out)])
    for c, text, transcript in zip([c for row in out for c in row], inputs.texts, inputs.kwargs["transcript"]):
        first = c.sampled_mask.index(0)
        second = first + len(tok(FEEDBACK, add_special_tokens=False)["input_ids"])
        said = [tok.decode(c.token_ids[:first], skip_special_tokens=True)]
        said.append(tok.decode(c.token_ids[second:], skip_special_tokens=True))
        assert text == "\n".join(t for t in said if t) and FEEDBACK not in text
        assert transcript == c.text and FEEDBACK in transcript


@pytest.mark.parametrize(
    "fn, said",
    [
        ("short_of_one", "'completion_ids' has 3 entries; it needs one per completion, 2 prompts x 2 generations = 4"),
        ("no_logprobs", "returned no logprobs"),
        ("empty_prompt", "completion 0's prompt_ids are empty"),
    ],
)
def test_a_malformed_return_is_refused_with_the_key_and_the_fix(engine_and_prompts, fn, said):
    cfg, tok, engine, prompts = engine_and_prompts
    with pytest.raises(RolloutFuncError, match=said.replace("(", r"\(").replace("*", r"\*")):
        hooked(cfg, tok, fn).run(engine, prompts, SamplingParams(max_tokens=30, seed=5), 2)


def test_returned_prompt_ids_are_the_tokens_each_completion_continues(engine_and_prompts):
    """As TRL's rollout_func: a completion trains after the prompt_ids returned for it."""
    from plait.train.batch import collate
    from plait.types import Group

    cfg, tok, engine, prompts = engine_and_prompts
    out = hooked(cfg, tok, "other_prompt").run(engine, prompts, SamplingParams(max_tokens=30, seed=5), 2)
    batch = collate([Group(p, row) for p, row in zip(prompts, out)], engine.pad_id)
    for k, c in enumerate(c for row in out for c in row):
        own = [1] + prompts[k // 2].token_ids
        assert c.prompt_ids == own
        assert batch.input_ids[k, batch.prompt_len - len(own) : batch.prompt_len].tolist() == own


def test_config_mistakes_are_refused_before_a_model_loads(tiny_model_path, prompts_jsonl):
    def problems(*extra):
        cfg = load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, "/unused", *extra))
        return check_user_loops(cfg, probe(cfg, 1))

    assert problems("rollout.rollout_func=rollout_funcs:two_turns") == []
    assert any("no function 'nowhere'" in p for p in problems("rollout.rollout_func=rollout_funcs:nowhere"))
    both = problems("rollout.rollout_func=rollout_funcs:two_turns", "rollout.tools={format: hermes, python: true}")
    assert any("plait's tool loop can't run beside it" in p for p in both)


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_a_run_trains_through_the_loop_and_its_fields_reach_the_rewards(
    tiny_model_path, prompts_jsonl, tmp_path, staleness
):
    """Synchronous, and asynchronous (k = 1: the loop runs in rank 0's producer thread, its
    generate calls reach the generation process)."""
    result = two_rounds(
        tiny_model_path,
        prompts_jsonl,
        tmp_path / "run",
        staleness,
        "rollout.rollout_func=rollout_funcs:two_turns",
        "rewards=[{name: 'rollout_funcs:turns_reward'}, {name: 'plait_test_rewards:vowel_share'}]",
    )
    assert len(result.history) == 2
    for m in result.history:
        assert m["reward/rollout_funcs:turns_reward/mean"] == 1.0  # the loop's `turns` field, 2 for every completion
    # the returned log-probs are the engine's: the trainer agrees where both hold the same weights
    # (asynchronous round 2 was sampled a version behind the weights it trains)
    same_weights = result.history if staleness == 0 else result.history[:1]
    assert all(m["logprob_gap"] < 1e-4 for m in same_weights)


def two_rounds(model, prompts, out, staleness: int, *extra):
    """2 rounds of the tiny model, completions of up to 24 tokens, `staleness` rounds ahead: the result."""
    sets = ["rollout.max_completion_length=24", "train.max_steps=2", f"rollout.max_staleness={staleness}", *extra]
    return train(load_config(None, tiny_overrides(model, prompts, out, *sets)))
