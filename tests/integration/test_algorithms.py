"""Every loss type and algorithm option, end to end on a tiny model, plus the invariances
that make them trustworthy (micro-batch split, ratio exactly 1 on a first pass)."""

import contextlib
import math

import pytest
import torch
from test_train import tiny_overrides

from plait.algo.losses import LOSS_TYPES, LossSettings, StepCounts
from plait.algo.stats import Sums
from plait.config import load_config
from plait.models import load_model, load_tokenizer
from plait.rollout.hf import HFEngine
from plait.telemetry import PhaseTimer
from plait.train.backends import LocalBackend
from plait.train.batch import collate, micro_batches
from plait.train.loop import train
from plait.train.update import (
    accumulate_gradients,
    logprob_prepass,
    train_micro_batch,
    why_nothing_is_skipped,
)
from plait.types import Group, Prompt, SamplingParams


def run(tiny_model_path, prompts_jsonl, tmp_path, *extra, steps=2):
    cfg = load_config(
        None, tiny_overrides(tiny_model_path, prompts_jsonl, tmp_path / "run", f"train.max_steps={steps}", *extra)
    )
    return train(cfg)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_each_loss_type_trains(tiny_model_path, prompts_jsonl, tmp_path, loss_type):
    result = run(tiny_model_path, prompts_jsonl, tmp_path, f"algo.loss_type={loss_type}", "algo.epsilon_high=0.28")
    assert len(result.history) == 2
    assert all(m["grad_norm"] > 0 and m["loss"] == m["loss"] for m in result.history)


def test_first_pass_ratio_is_exactly_one(tiny_model_path, prompts_jsonl, tmp_path):
    result = run(tiny_model_path, prompts_jsonl, tmp_path, "algo.loss_type=grpo")
    for m in result.history:
        assert m["ratio/mean"] == 1.0 and m["clip/fraction"] == 0.0


TWO_REWARDS = (
    "rewards=[{name: 'plait_test_rewards:vowel_share'}, {name: length_penalty, weight: 0.1, kwargs: {max_tokens: 12}}]"
)


KL_IN_REWARD = ["algo.beta=0.05", "algo.kl_in_reward=true", "train.micro_batch_size=2"]


def _weights_moved_apart(a, b) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def _final(result):
    from safetensors.torch import load_file

    return load_file(str(result.run_dir / "final" / "model.safetensors"))


# Each option against the same run without it (the baseline's extra settings), and what the
# option must do beyond changing the weights.
OPTIONS = {
    "gspo": (
        ["algo.importance_sampling_level=sequence", "algo.num_iterations=2", "algo.loss_type=grpo"],
        ["algo.num_iterations=2", "algo.loss_type=grpo"],
        lambda h, b: all(m["ratio/mean"] != 1.0 for m in h),  # the second pass sees a moved policy
    ),
    "delta": (
        ["algo.delta=1.21", "algo.num_iterations=2", "train.learning_rate=0.01"],
        ["algo.num_iterations=2", "train.learning_rate=0.01"],
        lambda h, b: sum(m["clip/delta"] for m in h) > 0,  # some ratio passed delta and was capped
    ),
    "kl-in-reward": (
        ["algo.beta=0.05", "algo.kl_in_reward=true", "algo.kl_estimator=k1"],
        ["algo.beta=0.05", "algo.kl_estimator=k1"],
        # the penalty is in the advantages, not the loss: the loss holds no KL term
        lambda h, b: "kl" not in h[-1] and b[-1]["kl"] != 0.0,
    ),
    "ref-sync": (
        ["algo.beta=0.05", "algo.ref_model_sync_steps=1", "algo.ref_model_mixup_alpha=0.5", "algo.kl_estimator=k2"],
        ["algo.beta=0.05", "algo.kl_estimator=k2"],
        # one sync per round, and the reference pulled halfway to the policy: less KL than without
        lambda h, b: [m["ref_syncs"] for m in h] == [1.0, 1.0] and h[-1]["kl"] < b[-1]["kl"],
    ),
    "entropy-filter": (
        ["algo.top_entropy_quantile=0.2"],
        [],
        lambda h, b: all(0.1 < m["tokens/trained_share"] < 0.5 for m in h),  # about 20% of tokens trained on
    ),
    "entropy-bonus": (
        ["algo.entropy_coeff=0.5"],
        [],
        # the bonus is subtracted from the loss: at the first round (same policy) by coeff x entropy
        lambda h, b: h[0]["loss"] == pytest.approx(b[0]["loss"] - 0.5 * h[0]["entropy"], rel=1e-4, abs=1e-6),
    ),
    "engine-is": (
        ["algo.engine_is_correction=true", "algo.engine_is_cap=2.0"],
        ["algo.engine_is_correction=false"],
        # there is a gap to correct, too small for the cap of 2 to truncate any token
        lambda h, b: all(m["logprob_gap"] > 0 and m["engine/is_truncated"] == 0 for m in h),
    ),
    "engine-is-mask": (
        # every token whose trainer log-prob exceeds the engine's is left out (ratio above a cap of 1)
        ["algo.engine_is_correction=true", "algo.engine_is_mode=token_mask", "algo.engine_is_cap=1.0"],
        ["algo.engine_is_correction=false"],
        lambda h, b: (
            all(0 < m["engine/is_masked"] < 1 and m["engine/is_truncated"] == 0 for m in h)
            and "engine/is_masked" not in b[0]
            and b[0]["engine/kl"] >= 0
        ),
    ),
    "steps-per-generation": (
        ["algo.steps_per_generation=2", "algo.num_iterations=2", "train.lr_by_signal=false"],
        ["train.lr_by_signal=false"],
        # 4 updates a round: round 1's mean LR over warmup (0.5, 1) and cosine (1, cos(pi/6))
        lambda h, b: (
            h[0]["lr"] == pytest.approx(1e-3 * (0.5 + 1 + 1 + (1 + math.cos(math.pi / 6)) / 2) / 4)
            and b[0]["lr"] == pytest.approx(0.5e-3)
        ),
    ),
    "gdpo": (
        ["algo.reward_aggregation=normalize_then_sum", TWO_REWARDS],
        [TWO_REWARDS],
        lambda h, b: h[0]["reward/total/mean"] == b[0]["reward/total/mean"],  # same samples, other advantages
    ),
    "rloo": (
        ["algo.advantage_estimator=rloo"],
        [],
        lambda h, b: h[0]["reward/total/mean"] == b[0]["reward/total/mean"],  # same samples, other advantages
    ),
    "reinforce-pp-token-kl": (
        # token advantages [B, C] through micro-batches cut to their own length
        ["algo.advantage_estimator=reinforce_pp", *KL_IN_REWARD],
        KL_IN_REWARD,
        lambda h, b: h[0]["reward/total/mean"] == b[0]["reward/total/mean"] and "kl" not in h[-1],
    ),
    "overlong": (
        [
            "rewards=[{name: soft_overlong_punishment, kwargs: {max_length: 12, cache: 4}}, "
            "{name: 'plait_test_rewards:vowel_share'}]"
        ],
        [],
        # completions of 9..12 tokens are punished (a random model rarely stops before 12)
        lambda h, b: all(m["reward/soft_overlong_punishment/mean"] < 0 for m in h),
    ),
}


@pytest.fixture(scope="module")
def baselines(tiny_model_path, prompts_jsonl, tmp_path_factory):
    """The runs without each option, cached by their settings (several options share one)."""
    cache = {}

    def get(extra: list[str]):
        key = tuple(extra)
        if key not in cache:
            cache[key] = run(tiny_model_path, prompts_jsonl, tmp_path_factory.mktemp("baseline"), *extra)
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_has_its_effect(tiny_model_path, prompts_jsonl, tmp_path, baselines, name):
    extra, without, effect = OPTIONS[name]
    result, base = run(tiny_model_path, prompts_jsonl, tmp_path, *extra), baselines(without)
    assert len(result.history) == 2
    assert all(v == v for m in result.history for v in m.values() if isinstance(v, float))  # no NaN
    assert _weights_moved_apart(_final(result), _final(base))  # the option changed the training
    assert effect(result.history, base.history), (result.history, base.history)


def test_dynamic_sampling_refills_and_reports(tiny_model_path, prompts_jsonl, tmp_path):
    # a reward that is constant (uninformative) for the prompts of even length
    result = run(
        tiny_model_path,
        prompts_jsonl,
        tmp_path,
        "algo.dynamic_sampling=true",
        "algo.max_sampling_rounds=3",
        "rewards=[{name: 'plait_test_rewards:sometimes_constant'}]",
    )
    for m in result.history:
        assert 1 <= m["sampling/rounds"] <= 3
        assert m["sampling/generated_groups"] >= 2
        assert m["sampling/informative_kept"] <= 2
    # half the prompts are uninformative, so some step needed a refill round
    assert any(m["sampling/rounds"] > 1 for m in result.history)
    assert any(m["sampling/informative_kept"] == 2 for m in result.history)


def test_dapo_gradient_does_not_depend_on_micro_batching(tiny_model_path):
    """The same batch in 1, 2 or 4 micro-batches gives the same gradient, for every aggregation
    that claims it (all but bnpo, whose normalizer is each micro-batch's own token count)."""
    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path))
    prompts = [
        Prompt(i, t, tok(t)["input_ids"])
        for i, t in enumerate(["What is 2 + 2?", "A much longer prompt about colours and shapes"])
    ]
    outs = HFEngine(model, tok).generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=3), n=4)
    batch = collate([Group(p, cs) for p, cs in zip(prompts, outs)], tok.pad_token_id)
    batch.advantages = torch.randn(8, generator=torch.Generator().manual_seed(0))
    backend = LocalBackend.wrap(model)
    for loss_type in ("dapo", "grpo", "dr_grpo", "cispo"):
        cfg = load_config(
            None, [f"algo.loss_type={loss_type}", "train.precision=fp32", "rollout.max_completion_length=10"]
        )
        grads = []
        for size in (8, 4, 2):
            model.zero_grad()
            mbs = micro_batches(batch, size)
            counts = StepCounts(8, int(batch.completion_mask.sum()), len(mbs), 10)
            for mb in mbs:
                train_micro_batch(model, mb, counts, cfg, LossSettings.from_algo(cfg.algo), backend)
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert grads[0].abs().max() > 0
        for g in grads[1:]:
            assert torch.allclose(grads[0], g, atol=1e-6, rtol=1e-4), loss_type


def test_a_bf16_update_casts_each_weight_once_for_all_its_micro_batches(tiny_model_path):
    """Under bf16 autocast an update's micro-batches share one cast of each weight (the backend's
    keep_casts): the gradient is torch.equal to the one with every micro-batch casting again,
    with fewer casts (counted by torch.profiler), and the next update casts the new weights."""
    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path))
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour"])]
    outs = HFEngine(model, tok).generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=3), n=4)
    batch = collate([Group(p, cs) for p, cs in zip(prompts, outs)], tok.pad_token_id)
    batch.advantages = torch.randn(8, generator=torch.Generator().manual_seed(0))
    cfg = load_config(None, ["train.precision=bf16", "train.micro_batch_size=2", "rollout.max_completion_length=10"])
    backend = LocalBackend.wrap(model, precision="bf16")
    weights = sum(1 for p in model.parameters() if p.requires_grad and p.dim() == 2)

    def update(keep: bool):
        model.zero_grad()
        if not keep:
            backend.keep_casts = contextlib.nullcontext
        with torch.profiler.profile() as prof:
            accumulate_gradients(batch, cfg, LossSettings.from_algo(cfg.algo), backend, PhaseTimer(), Sums())
        backend.__dict__.pop("keep_casts", None)
        casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), casts

    (kept, kept_casts), (each, each_casts) = update(True), update(False)
    assert kept.abs().max() > 0 and torch.equal(kept, each)
    assert each_casts - kept_casts >= 3 * weights  # 4 micro-batches: 3 casts of each weight saved
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # an optimizer step between updates: the next one casts these
    moved, _ = update(True)
    assert torch.equal(moved, update(False)[0]) and not torch.equal(moved, kept)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "bnpo"])
def test_leaving_zero_advantage_rows_out_keeps_the_gradient(tiny_model_path, loss_type):
    """Completions whose advantage is zero are left out of the forward and backward, and the
    gradient equals the one over every row (the normalizer stays the whole batch's), for each
    aggregation that skips; bnpo, whose normalizer is each micro-batch's tokens, trains every row.
    An all-zero batch runs one micro-batch (a zero gradient the backend still steps on)."""
    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path))
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour", "Hi"])]
    outs = HFEngine(model, tok).generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=5), n=4)
    batch = collate([Group(p, cs) for p, cs in zip(prompts, outs)], tok.pad_token_id)
    adv = torch.randn(12, generator=torch.Generator().manual_seed(1))
    adv[4:8] = 0.0  # the second group all-equal
    adv[0] = 0.0  # and one completion of the first exactly at its group's mean
    backend = LocalBackend.wrap(model)

    def gradient(skip: bool, advantages: torch.Tensor):
        cfg = load_config(
            None,
            [
                f"algo.loss_type={loss_type}",
                "train.precision=fp32",
                "train.micro_batch_size=2",
                "rollout.max_completion_length=10",
                f"train.skip_zero_advantage={str(skip).lower()}",
            ],
        )
        batch.advantages = advantages
        model.zero_grad()
        sums = Sums()
        accumulate_gradients(batch, cfg, LossSettings.from_algo(cfg.algo), backend, PhaseTimer(), sums)
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return grad, sums.metrics(), why_nothing_is_skipped(cfg)

    full, full_metrics, _ = gradient(False, adv)
    skipped, metrics, why = gradient(True, adv)
    assert full.abs().max() > 0
    assert torch.allclose(full, skipped, atol=1e-7, rtol=1e-5), (full - skipped).abs().max()
    assert full_metrics["update/skipped_rows"] == 0.0 and full_metrics["update/forwarded_share"] == 1.0
    kept = batch.completion_mask[adv != 0].sum() / batch.completion_mask.sum()  # what MFU counts as trained
    if loss_type != "bnpo":
        assert metrics["update/forwarded_share"] == pytest.approx(float(kept))
    if loss_type == "bnpo":
        assert why == "bnpo's normalizer is each micro-batch's token count" and metrics["update/skipped_rows"] == 0.0
    else:
        assert why is None and metrics["update/skipped_rows"] == 5 / 12  # the 7 informative rows alone
    zero, zero_metrics, _ = gradient(True, torch.zeros(12))
    assert zero.abs().max() == 0.0
    if loss_type != "bnpo":
        assert zero_metrics["update/skipped_rows"] == 11 / 12  # one micro-batch of 1 row still runs


def test_the_old_log_prob_pass_leaves_zero_advantage_rows_out_too(tiny_model_path):
    """With num_iterations 2 the old log-probs come from a prepass. Where the update leaves
    zero-advantage rows out, the prepass forwards only the rows it trains: their old log-probs
    equal those of a prepass over every row, the gradient of an update that reads them is the
    same, and the forward work it reports is the kept rows' share of the loss tokens."""
    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path))
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour", "Hi"])]
    outs = HFEngine(model, tok).generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=5), n=4)
    batch = collate([Group(p, cs) for p, cs in zip(prompts, outs)], tok.pad_token_id)
    batch.advantages = torch.randn(12, generator=torch.Generator().manual_seed(1))
    batch.advantages[4:8] = 0.0  # the second group all-equal
    backend = LocalBackend.wrap(model)
    useful = batch.advantages != 0

    def prepass_and_gradient(skip: bool):
        cfg = load_config(
            None,
            [
                "algo.num_iterations=2",
                "train.precision=fp32",
                "train.micro_batch_size=2",
                "rollout.max_completion_length=10",
                f"train.skip_zero_advantage={str(skip).lower()}",
            ],
        )
        forwards = logprob_prepass(batch, cfg, backend)
        old = batch.old_logprobs.clone()
        model.zero_grad()
        accumulate_gradients(batch, cfg, LossSettings.from_algo(cfg.algo), backend, PhaseTimer(), Sums())
        return old, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), forwards

    old_all, grad_all, forwards_all = prepass_and_gradient(False)
    old_kept, grad_kept, forwards_kept = prepass_and_gradient(True)
    assert forwards_all == 1.0
    kept_share = float(batch.completion_mask[useful].sum() / batch.completion_mask.sum())
    assert forwards_kept == pytest.approx(kept_share) and kept_share < 1.0
    assert torch.allclose(old_kept[useful], old_all[useful], atol=1e-5, rtol=0)
    assert old_kept[~useful].abs().max() == 0.0 and old_all[~useful].abs().max() > 0  # never forwarded
    assert grad_all.abs().max() > 0
    assert torch.allclose(grad_kept, grad_all, atol=1e-7, rtol=1e-5), (grad_kept - grad_all).abs().max()


def test_lr_by_signal_scales_the_step_by_the_share_of_completions_that_carry_a_gradient(tiny_model_path):
    """train.lr_by_signal: with 7 of 12 completions carrying a gradient, AdamW's first update
    (lr x g / (|g| + eps): the rate times the gradient's sign where |g| >> eps) moves every
    weight 7/12 as far as without it; the logged rate says so, and the schedule goes on as usual."""
    from plait.train.optim import make_optimizer
    from plait.train.update import policy_update

    tok = load_tokenizer(str(tiny_model_path))
    prompts = [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(["What is 2 + 2?", "Name a colour", "Hi"])]
    start = load_model(str(tiny_model_path))
    outs = HFEngine(start, tok).generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=5), n=4)
    adv = torch.randn(12, generator=torch.Generator().manual_seed(1))
    adv[4:8] = 0.0  # the second group all-equal
    adv[0] = 0.0  # and one completion of the first exactly at its group's mean
    moves, metrics = [], []
    for on in (False, True):
        cfg = load_config(
            None,
            [
                "train.precision=fp32",
                "train.micro_batch_size=4",
                "rollout.max_completion_length=10",
                "train.warmup_steps=0",
                "train.learning_rate=1e-3",
                "train.max_grad_norm=null",
                f"train.lr_by_signal={str(on).lower()}",
            ],
        )
        model = load_model(str(tiny_model_path))
        before = [p.detach().clone() for p in model.parameters()]
        backend = LocalBackend.wrap(model, *make_optimizer(model, cfg))
        batch = collate([Group(p, cs) for p, cs in zip(prompts, outs)], tok.pad_token_id)
        batch.advantages = adv
        metrics.append(policy_update(batch, cfg, backend))
        moves.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
        assert backend.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # the schedule's own rate again
    plain, scaled = moves
    big = plain.abs() > 0.9e-3  # weights whose gradient dwarfs Adam's eps: moved by the whole rate
    assert big.float().mean() > 0.5
    # up to the rounding of a weight near 1 in fp32 (1.2e-7 an ulp), which the moves inherit
    torch.testing.assert_close(scaled[big], plain[big] * 7 / 12, rtol=1e-4, atol=2.5e-7)
    assert metrics[0]["update/signal_share"] == metrics[1]["update/signal_share"] == pytest.approx(7 / 12)
    assert metrics[0]["lr"] == pytest.approx(1e-3) and metrics[1]["lr"] == pytest.approx(1e-3 * 7 / 12)
