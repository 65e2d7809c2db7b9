"""The optimizer: fused AdamW where it applies, the same update as the reference loop."""

import pytest
import torch

from plait.config import load_config
from plait.train.optim import can_fuse, make_optimizer


def test_fused_adamw_matches_the_plain_one():
    torch.manual_seed(0)
    cfg = load_config(None, ["train.learning_rate=1e-2", "train.weight_decay=0.1"])
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    b.load_state_dict(a.state_dict())
    fused, _ = make_optimizer(a, cfg)
    plain, _ = make_optimizer(b, cfg, fused=False)
    assert fused.param_groups[0]["fused"] is True and not plain.param_groups[0]["fused"]
    x = torch.randn(8, 16)
    for _ in range(3):
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_only_plain_float_parameters_are_fused():
    assert can_fuse([torch.nn.Parameter(torch.zeros(3))])
    assert not can_fuse([torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])
    assert not can_fuse([])


def test_lr_schedules_by_hand():
    from plait.train.optim import lr_factor

    assert [lr_factor(s, 2, 10, "constant") for s in (0, 1, 5)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, 2, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 2, 10, "cosine") == pytest.approx(0.0)
    # transformers' cosine_with_min_lr (min_lr_rate=0.1): factor * 0.9 + 0.1
    assert lr_factor(6, 2, 10, "cosine", floor=0.1) == pytest.approx(0.55)
    assert lr_factor(10, 2, 10, "cosine", floor=0.1) == pytest.approx(0.1)
    assert lr_factor(10, 2, 10, "linear", floor=0.1) == pytest.approx(0.1)
    # warmup-stable-decay: the peak until the last half of the 8 updates after warmup, then decay
    wsd = [lr_factor(s, 2, 10, "linear", decay_ratio=0.5) for s in range(11)]
    assert wsd[:6] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0] and wsd[7] == pytest.approx(0.75) and wsd[10] == 0.0
    assert lr_factor(8, 2, 10, "cosine", decay_ratio=0.5) == pytest.approx(0.5)
    assert lr_factor(5, 2, 10, "constant", decay_ratio=0.5) == 1.0
    full = [lr_factor(s, 2, 10, "cosine", 0.1) for s in range(11)]  # decay_ratio 1: transformers' schedule
    assert full == [lr_factor(s, 2, 10, "cosine", 0.1, decay_ratio=1.0) for s in range(11)]
