import random

import numpy as np
import pytest
import torch
from optimizer_state import assert_same_optimizer_state

from plait.checkpoint import (
    MARKER,
    CheckpointDamaged,
    complete_checkpoints,
    damage,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from plait.config import load_config
from plait.config.checks import check_resume
from plait.train.backends import LocalBackend


def _parts(seed=0, steps=1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return LocalBackend.wrap(model, opt, sched)


def _draws() -> dict:
    """The next numbers of every generator a checkpoint saves (CUDA's where there is one)."""
    out = {"python": [random.random() for _ in range(3)], "numpy": np.random.random(3).tolist(), "torch": torch.rand(3)}
    if torch.cuda.is_available():
        out["cuda"] = [torch.rand(3, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    return out


def _same_draws(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for k in a
        for x, y in (zip(a[k], b[k]) if k == "cuda" else [(a[k], b[k])])
    )


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    saved = _parts(steps=2)  # a state a fresh one (1 step) differs from in every part, the step counts too
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    path = save_checkpoint(tmp_path, 5, saved, {"prompts_consumed": 40})
    expected = _draws()
    fresh = _parts(seed=99)
    random.seed(99), np.random.seed(99)  # every generator moved on from where it was saved
    assert not _same_draws(_draws(), expected)
    state = load_checkpoint(path, fresh)
    assert state == {"step": 5, "backend": "local", "world_size": 1, "prompts_consumed": 40}
    for a, b in zip(saved.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_same_optimizer_state(fresh.optimizer.state_dict(), saved.optimizer.state_dict())
    assert fresh.scheduler.state_dict() == saved.scheduler.state_dict()
    assert fresh.scheduler.get_last_lr() == saved.scheduler.get_last_lr()
    assert _same_draws(_draws(), expected)  # python, numpy, torch (and CUDA) continue where they were saved


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


def test_a_checkpoint_damaged_after_its_commit_is_named_and_the_older_whole_one_offered(tmp_path):
    """The marker records every file's size at commit: a file cut short or lost afterwards is
    named, nothing is loaded from it, and a resume is refused before anything loads, naming the
    newest older checkpoint still whole (or saying none is); a marker without sizes (written
    before they were recorded) is not checked."""
    backend = _parts()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, backend, {})
    first, second = complete_checkpoints(tmp_path)
    assert damage(first) is None and damage(second) is None
    weights = second / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:100])
    assert damage(second) == f"model.safetensors holds 100 bytes, {size:,} when it was written"
    with pytest.raises(CheckpointDamaged, match="nothing was loaded"):
        load_checkpoint(second, _parts(seed=1))
    cfg = load_config(None, [f"output_dir={tmp_path}", "resume=auto"])
    (said,) = check_resume(cfg, None)
    assert f"checkpoint {second} is damaged: model.safetensors holds 100 bytes" in said
    assert f"continue from the one before it with resume={first}" in said, said
    (first / "optimizer.pt").unlink()
    assert damage(first) == "optimizer.pt is missing"
    (said,) = check_resume(cfg, None)
    assert "no older checkpoint is whole" in said, said
    (second / MARKER).write_text("ok\n")
    assert damage(second) is None


def test_retention_keeps_the_newest(tmp_path):
    backend = _parts()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, backend, {}, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_a_checkpoint_of_each_format_exports_as_a_model_folder(tmp_path, tiny_model_path):
    """`plait eval RUN/checkpoints/step_N` (and model.name_or_path: a checkpoint): the local/DDP
    safetensors (adapters only under LoRA, merged on export) and FSDP2's DCP shards become a plain
    HF folder beside them whose weights are the checkpoint's, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from plait.config import Config
    from plait.models import load_model, model_path_problem, resolve_model_path
    from plait.train.export import model_folder

    for form, lora in [("safetensors", None), ("safetensors", {"r": 4, "alpha": 8}), ("dcp", None)]:
        run = tmp_path / f"{form}-{lora is not None}"
        cfg = Config.model_validate({"model": {"name_or_path": str(tiny_model_path), "lora": lora}})
        run.mkdir()
        (run / "config.yaml").write_text(cfg.to_yaml())
        model = load_model(str(tiny_model_path), lora=cfg.model.lora)
        torch.manual_seed(len(str(run)))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.01)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        path = save_checkpoint(run, 3, LocalBackend.wrap(model, opt, sched), {})
        if form == "dcp":  # what FSDP2 writes, from one process
            (path / "model.safetensors").unlink()
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(path / "dcp"), no_dist=True)
        assert "is a checkpoint (training state, not a model folder): `plait eval" in model_path_problem(str(path))
        folder = model_folder(str(path))
        assert folder == str(path / "model") and model_folder(str(path)) == folder  # exported once
        assert model_path_problem(str(path)) is None and resolve_model_path(str(path)) == path / "model"
        expected = (model.merge_and_unload() if lora else model).state_dict()
        got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), form
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text("{}")
    assert "a run directory without final/ (the run did not finish): it saved no checkpoint" in model_path_problem(
        str(unfinished)
    )
    assert f"`plait eval` its last checkpoint, '{path}'" in model_path_problem(str(path.parent.parent))


def test_rounds_held_ahead_load_after_the_completion_fields_changed(tmp_path):
    """An asynchronous run's rollouts.pt pickles Completions: one written before `info` and
    `columns` (with tool_stats, agent_stats, extra) loads with its numbers under the new names,
    and one written now loads as it was."""
    import dataclasses

    from plait.checkpoint import ROLLOUTS, load_rollouts
    from plait.types import Completion

    now = Completion(0, [5, 6], "hi", [-0.1, -0.2], False, "eos", info={"tools/calls": 1.0}, columns={"k": 2})
    old = Completion(0, [5, 6], "hi", [-0.1, -0.2], False, "eos")
    del old.info, old.columns  # as a Completion of the earlier release held them
    old.__dict__.update(tool_stats={"calls": 2.0}, agent_stats={"forks": 1.0}, extra={"turns": 2})
    torch.save([old, now], tmp_path / ROLLOUTS)
    old_back, now_back = load_rollouts(tmp_path)
    assert old_back.info == {"tools/calls": 2.0, "agent/forks": 1.0} and old_back.columns == {"turns": 2}
    assert not hasattr(old_back, "tool_stats") and not hasattr(old_back, "extra")
    assert dataclasses.asdict(now_back) == dataclasses.asdict(now)
    older = Completion(0, [1], "x", [0.0], False, "eos")
    del older.model_text, older.info  # fields a still older release did not have take their defaults
    torch.save([older], tmp_path / ROLLOUTS)
    (back,) = load_rollouts(tmp_path)
    assert back.model_text is None and back.info is None and back.scored_text == "x"
