"""Comparing optimizer states, for the checkpoint and non-finite-skip tests."""

import torch


def assert_same_optimizer_state(got: dict, want: dict) -> None:
    """Two optimizer state dicts agree: every tensor of every parameter's state (AdamW's step,
    exp_avg, exp_avg_sq) `torch.equal`, and the param groups (lr, betas, weight decay...) `==`."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, kept in want["state"].items():
        assert got["state"][i].keys() == kept.keys() == {"step", "exp_avg", "exp_avg_sq"}, i
        for name, value in kept.items():
            assert torch.equal(got["state"][i][name], value), (i, name)
