"""plait's policy loss against TRL's own: the installed TRL's `GRPOTrainer._compute_loss`, its
very source run on the same log-probs, advantages and masks (float64), for every loss type
both have, token and sequence ratios, two-sided clipping, the KL term with and without its bias
correction, the entropy bonus, and one or two micro-batches. Loss and gradient agree to
float64 rounding except where docs/algorithms.md ("Where TRL differs") says they do not."""

import ast
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl_source import trl_source

from plait.algo.losses import LossSettings, StepCounts, policy_loss


def trl_compute_loss():
    """TRL's `GRPOTrainer._compute_loss` as a plain function of (self, model, inputs)."""
    src = trl_source("trainer/grpo_trainer")
    trainer = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    method = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    scope = {
        "torch": torch,
        "nanmin": lambda t: t[~t.isnan()].min(),
        "nanmax": lambda t: t[~t.isnan()].max(),
    }
    exec(textwrap.dedent(ast.get_source_segment(src, method)), scope)
    return scope["_compute_loss"]


def trl_self(case: dict, logp: torch.Tensor, entropy: torch.Tensor, accumulation: int, max_len: int):
    """The trainer state `_compute_loss` reads, set up as `case` says; the model's forward pass
    is replaced by the given log-probs and entropies (rows picked by the micro-batch's ids)."""
    identity = lambda t, **_: t  # noqa: E731 (one process: gather and reduce return their input)
    cap = case.get("cispo_cap")
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, input_ids, *a, **k: (
            logp[input_ids[:, 0]],
            entropy[input_ids[:, 0]],
            None,
        ),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=case.get("level", "token"),
        beta=case.get("beta", 0.0),
        loss_type=case["loss_type"],
        epsilon_low=0.2,
        epsilon_high=cap if cap is not None else case.get("epsilon_high", 0.2),
        args=SimpleNamespace(
            use_bias_correction_kl=case.get("bias_correction", False),
            delta=case.get("delta"),
            steps_per_generation=accumulation,
        ),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=max_len,
        accelerator=SimpleNamespace(
            num_processes=1, gather=identity, reduce=identity, gather_for_metrics=identity, sync_gradients=True
        ),
        _entropy_bonus_enabled=bool(case.get("entropy_coeff")),
        use_adaptive_entropy=False,
        entropy_coef=case.get("entropy_coeff", 0.0),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )


CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dapo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "cispo", "cispo_cap": 1.3},
    {"loss_type": "grpo", "level": "sequence"},
    {"loss_type": "dapo", "level": "sequence", "epsilon_high": 0.28},
    {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "dr_grpo", "beta": 0.1, "bias_correction": True},
    {"loss_type": "bnpo", "entropy_coeff": 0.05},
    {"loss_type": "dapo", "entropy_coeff": 0.05, "beta": 0.04},
    {"loss_type": "cispo", "cispo_cap": 1.3, "entropy_coeff": 0.05},
    {"loss_type": "grpo", "entropy_coeff": 0.05},
    {"loss_type": "dr_grpo", "entropy_coeff": 0.05},
]


def ragged_batch(rows: int, width: int, seed: int):
    """Log-probs of a policy that moved away from the one that sampled (ratios well outside the
    clip range), a reference, entropies, advantages of both signs, completions of many lengths."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.4
    ref = logp + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3
    entropy = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float64)
    return logp, old, ref, entropy, advantages, mask


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_plait_loss_equals_trls_compute_loss(case, micro_batches):
    compute_loss = trl_compute_loss()
    rows, width = 8, 12
    logp, old, ref, entropy, advantages, mask = ragged_batch(rows, width, seed=len(str(case)) + micro_batches)
    counts = StepCounts(rows, int(mask.sum()), micro_batches, width)
    settings = LossSettings(
        loss_type=case["loss_type"],
        epsilon=0.2,
        epsilon_high=case.get("epsilon_high"),
        delta=case.get("delta"),
        importance_sampling_level=case.get("level", "token"),
        beta=case.get("beta", 0.0),
        kl_bias_correction=case.get("bias_correction", False),
        entropy_coeff=case.get("entropy_coeff", 0.0),
        cispo_cap=case.get("cispo_cap"),
    )
    ours_logp = logp.clone().requires_grad_(True)
    theirs_logp = logp.clone().requires_grad_(True)
    trainer = trl_self(case, theirs_logp, entropy, micro_batches, width)
    ours = theirs = 0.0
    for part in torch.arange(rows).chunk(micro_batches):
        cut = slice(int(part[0]), int(part[-1]) + 1)
        mine = policy_loss(
            ours_logp[cut], old[cut], advantages[cut], mask[cut], counts, settings, ref[cut], entropy[cut]
        ).loss
        ours = ours + mine
        inputs = {
            "prompt_ids": part[:, None],  # the row ids: the stand-in forward pass looks its rows up by them
            "prompt_mask": torch.ones(len(part), 1),
            "completion_ids": torch.zeros(len(part), width, dtype=torch.long),
            "completion_mask": mask[cut],
            "advantages": advantages[cut],
            "old_per_token_logps": old[cut],
            "ref_per_token_logps": ref[cut],
            "num_items_in_batch": mask.sum(),  # TRL's: the tokens of the whole generation batch
        }
        theirs = theirs + compute_loss(trainer, None, inputs)
    per_step = case["loss_type"] in ("dapo", "cispo") and micro_batches > 1
    if case.get("entropy_coeff") and (case["loss_type"] in ("grpo", "dr_grpo") or per_step):
        # where TRL differs (docs/algorithms.md): its entropy bonus is each micro-batch's token mean,
        # plait's is aggregated like the loss (grpo: per sequence; dapo, cispo: the step's token mean)
        assert ours.item() != pytest.approx(theirs.item(), rel=1e-6)
        return
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-15)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_logp.grad, theirs_logp.grad, rtol=1e-10, atol=1e-14)
    assert ours_logp.grad.abs().sum() > 0  # the loss did depend on the policy's log-probs
