import torch

from plait.checkpoint import MARKER, complete_checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint
from plait.train.backends import LocalBackend


def _parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return LocalBackend.wrap(model, opt, sched)


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    saved = _parts()
    torch.manual_seed(123)
    path = save_checkpoint(tmp_path, 5, saved, {"prompts_consumed": 40})
    expected_draw = torch.rand(3)
    fresh = _parts(seed=99)
    state = load_checkpoint(path, fresh)
    assert state == {"step": 5, "backend": "local", "world_size": 1, "prompts_consumed": 40}
    for a, b in zip(saved.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(
        fresh.optimizer.state_dict()["state"][0]["exp_avg"], saved.optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert fresh.scheduler.get_last_lr() == saved.scheduler.get_last_lr()
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    backend = _parts()
    save_checkpoint(tmp_path, 1, backend, {})
    # a crash mid-save leaves a temp folder, and a folder whose marker never got written
    (tmp_path / "checkpoints" / "step_00000002.tmp").mkdir()
    half = tmp_path / "checkpoints" / "step_00000003"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"garbage")
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    try:
        load_checkpoint(half, backend)
        raise AssertionError("loaded a checkpoint without its marker")
    except FileNotFoundError as err:
        assert MARKER in str(err)


def test_retention_keeps_the_newest(tmp_path):
    backend = _parts()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, backend, {}, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
