"""Advantage estimators beside GRPO: golden values computed by hand, and RLOO against TRL's own
RLOOTrainer code where TRL is installed."""

import ast
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
from trl_source import trl_source

from plait.algo.advantages import (
    EPS,
    ESTIMATORS,
    group_advantages,
    opo_advantages,
    reinforce_pp_baseline_scores,
    reinforce_pp_returns,
    rloo_advantages,
    whiten,
)


nan = float("nan")
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
LENGTHS = torch.tensor([[2.0, 4.0, 6.0, 8.0], [1.0, 1.0, 1.0, 1.0]])


def test_rloo_subtracts_the_mean_of_the_others():
    a = rloo_advantages(REWARDS, LENGTHS)
    # group 0: r=1 -> 1 - (0+0+1)/3 = 2/3; r=0 -> 0 - 2/3
    # group 1: 3 - (1+2+2)/3 = 4/3; 1 - 7/3 = -4/3; 2 - 6/3 = 0
    expect = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]])
    assert torch.allclose(a, expect, atol=1e-6)
    # m / (m - 1) times GRPO's unscaled advantage
    assert torch.allclose(a, 4 / 3 * group_advantages(REWARDS, "none"), atol=1e-6)


def test_rloo_leaves_unscored_completions_out_of_the_baseline():
    r = torch.tensor([[1.0, nan, 0.0, 0.5], [1.0, nan, nan, nan]])
    a = rloo_advantages(r, torch.ones_like(r))
    # baseline of the first: mean(0, 0.5) = 0.25; of the third: mean(1, 0.5) = 0.75
    assert torch.allclose(a[0, [0, 2, 3]], torch.tensor([0.75, -0.75, 0.0]), atol=1e-6)
    assert a[0, 1].isnan() and a[1].isnan().all()  # alone in its group: no baseline, no signal


def test_rloo_batch_scale_whitens_the_advantages():
    a = rloo_advantages(REWARDS, LENGTHS, "batch")
    raw = rloo_advantages(REWARDS, LENGTHS).flatten()
    assert torch.allclose(a.flatten(), (raw - raw.mean()) / (raw.std() + EPS), atol=1e-6)


def test_opo_baseline_is_the_length_weighted_mean():
    a = opo_advantages(REWARDS, LENGTHS)
    b = (2 * 1 + 4 * 0 + 6 * 0 + 8 * 1) / 20  # = 0.5
    assert torch.allclose(a[0], torch.tensor([1 - b, -b, -b, 1 - b]))
    assert torch.allclose(a[1], REWARDS[1] - 2.0)  # equal lengths: the plain mean
    long_right = opo_advantages(REWARDS[:1], torch.tensor([[8.0, 2.0, 2.0, 8.0]]))
    assert long_right[0, 0] < a[0, 0]  # the longer the right answers, the higher the baseline


def test_reinforce_pp_returns_carry_the_future_kl():
    scores = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])  # the 9 sits on padding
    g = reinforce_pp_returns(scores, mask, kl, beta=0.5)
    expect = torch.tensor([[1 - 0.5 * 0.6, 1 - 0.5 * 0.5, 1 - 0.5 * 0.3], [-1 - 0.5, -1 - 0.25, 0.0]])
    assert torch.allclose(g, expect)
    assert torch.equal(reinforce_pp_returns(scores, mask, None, 0.5), scores[:, None] * mask)


def test_whitening_uses_the_token_statistics():
    values = torch.tensor([1.0, 3.0])
    # tokens: one with 1, three with 3 -> mean 2.5, biased var (2.25 + 3 * 0.25) / 4 = 0.75
    sums = (4.0, 1.0 + 9.0, 1.0 + 27.0)
    assert torch.allclose(whiten(values, sums, "batch"), (values - 2.5) / math.sqrt(0.75))
    assert torch.equal(whiten(values, sums, "none"), values - 2.5)
    assert torch.equal(whiten(values, (0.0, 0.0, 0.0), "batch"), torch.zeros(2))
    with pytest.raises(ValueError, match="batch or none"):
        whiten(values, sums, "group")


def test_reinforce_pp_baseline_centres_on_the_group_without_dividing():
    assert torch.allclose(reinforce_pp_baseline_scores(REWARDS, LENGTHS), group_advantages(REWARDS, "none"))
    assert torch.equal(ESTIMATORS["reinforce_pp"](REWARDS, LENGTHS, "batch"), REWARDS)


def _trl_rloo(rewards: torch.Tensor, num_generations: int, normalize: bool) -> torch.Tensor:
    """Run the advantage lines of TRL's RLOOTrainer._generate_and_score_completions, and its
    nanstd, as TRL ships them, on `rewards` (flat, NaN = unscorable)."""
    utils = ast.parse(trl_source("trainer/utils"))
    nanstd = next(f for f in utils.body if isinstance(f, ast.FunctionDef) and f.name == "nanstd")
    scope = {"torch": torch}
    exec(ast.get_source_segment(trl_source("trainer/utils"), nanstd), scope)
    src = trl_source("trainer/rloo_trainer")
    start = src.index("        grouped_rewards = rewards.view(-1, num_generations)")
    end = src.index("\n", src.index("        advantages = torch.nan_to_num(advantages, nan=0.0)", start))
    scope.update(rewards=rewards.clone(), num_generations=num_generations)
    scope["self"] = SimpleNamespace(normalize_advantages=normalize)
    exec(textwrap.dedent(src[start:end]), scope)
    return scope["advantages"]


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_equals_trls_rloo_trainer(normalize):
    torch.manual_seed(0)
    rewards = torch.randn(6, 4)
    rewards[1, 2] = nan  # an unscorable completion
    rewards[3, 1:] = nan  # a group with one scorable completion
    ours = torch.nan_to_num(rloo_advantages(rewards, torch.ones_like(rewards), "batch" if normalize else "none"))
    theirs = _trl_rloo(rewards.flatten(), 4, normalize)
    assert torch.allclose(ours.flatten(), theirs, atol=1e-6), (ours.flatten(), theirs)


def _round(estimator: str, *overrides: str):
    """step_advantages on two groups of three completions of lengths 1..3 tokens."""
    from plait.config.load import load_config
    from plait.train.update import step_advantages
    from plait.types import Batch

    cfg = load_config(None, [f"algo.advantage_estimator={estimator}", *overrides])
    groups = [SimpleNamespace(rewards={"r": [1.0, 0.0, None]}), SimpleNamespace(rewards={"r": [2.0, 2.0, 0.0]})]
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    torch.manual_seed(0)
    old = torch.randn(6, 3) - 2
    batch = Batch(
        input_ids=torch.zeros(6, 4, dtype=torch.long),
        attention_mask=torch.ones(6, 4, dtype=torch.long),
        completion_mask=mask,
        advantages=torch.zeros(6),
        prompt_len=1,
        old_logprobs=old,
        ref_logprobs=old + 0.3 * torch.randn(6, 3),
    )
    return step_advantages(groups, batch, cfg, ["r"], [1.0]), batch


def test_the_round_uses_the_configured_estimator():
    grpo, _ = _round("grpo")
    assert torch.allclose(grpo, group_advantages(torch.tensor([[1.0, 0.0, nan], [2.0, 2.0, 0.0]])).flatten())
    rloo, _ = _round("rloo")
    assert torch.allclose(rloo, torch.tensor([1.0, -1.0, 0.0, 1.0, 1.0, -2.0]))
    opo, _ = _round("opo")  # lengths 1, 2, 3: b = (1 + 0) / 3 in group 0, (2 + 4 + 0) / 6 = 1 in group 1
    assert torch.allclose(opo, torch.tensor([2 / 3, -1 / 3, 0.0, 1.0, 1.0, -1.0]))


def test_reinforce_pp_whitens_over_the_scored_tokens():
    adv, batch = _round("reinforce_pp")
    assert adv.shape == (6,) and adv[2] == 0  # one value per completion; the unscored one gets 0
    tokens = batch.completion_mask.sum(1).float()
    tokens[2] = 0
    mean = (adv * tokens).sum() / tokens.sum()
    var = (adv**2 * tokens).sum() / tokens.sum() - mean**2
    assert abs(float(mean)) < 1e-6 and float(var) == pytest.approx(1.0, abs=1e-5)
    assert adv[0] > adv[1] and adv[3] == adv[4]  # no baseline: the raw scores' order
    base, _ = _round("reinforce_pp_baseline")
    assert base[3] == base[4] and base[3] > base[0]  # group means subtracted: 2 - 4/3 > 1 - 1/2


def test_reinforce_pp_with_the_kl_in_the_reward_gives_token_advantages():
    adv, batch = _round("reinforce_pp", "algo.beta=0.1", "algo.kl_in_reward=true", "algo.kl_estimator=k1")
    mask = batch.completion_mask.clone()
    mask[2] = False  # unscored
    assert adv.shape == (6, 3) and torch.equal(adv[~mask], torch.zeros(int((~mask).sum())))
    assert abs(float(adv[mask].mean())) < 1e-6 and float(adv[mask].var(unbiased=False)) == pytest.approx(1, abs=1e-5)
    # the return of a token counts the KL from it to the end: within completion 5, the advantage
    # steps by beta x KL of the token left behind, over the round's std
    kl = batch.old_logprobs - batch.ref_logprobs
    step = (adv[5, 1] - adv[5, 0]) / (adv[4, 1] - adv[4, 0])
    assert float(step) == pytest.approx(float(kl[5, 0] / kl[4, 0]), rel=1e-4)


def test_every_name_the_config_offers_has_its_function_and_no_function_lacks_a_name():
    """The config chooses among plait.algo.names (so it loads without torch); each name must be a
    key of the table the trainer looks it up in, and each table entry a name the config accepts."""
    from plait.algo import names
    from plait.algo.kl import KL_ESTIMATORS
    from plait.algo.losses import AGGREGATIONS, OBJECTIVES

    assert tuple(ESTIMATORS) == names.ESTIMATOR_NAMES
    assert set(names.DEFAULT_SCALE) == set(ESTIMATORS) and set(names.DEFAULT_SCALE.values()) <= set(names.SCALES)
    assert set(names.TOKEN_WHITENED) <= set(ESTIMATORS)
    assert tuple(KL_ESTIMATORS) == names.KL_NAMES
    assert {o for o, _ in names.LOSS_TYPES.values()} == set(OBJECTIVES)
    assert {a for _, a in names.LOSS_TYPES.values()} == set(AGGREGATIONS)
