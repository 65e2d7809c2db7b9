"""The drift guard (train/guard.py check_drift): an engine that samples from other weights than
the trainer's stops the run before that round's checkpoint, in every engine layout; the
whole suite runs with it on (rollout.max_logprob_gap=auto), so it never fires on a healthy run.

The weights the engine gets are corrupted on their way, where each layout hands them over: the
HF engine in the training process samples through packed copies of the weights made when a
round's generation starts, the HF generation process (and a vLLM rollout server: test_vllm.py)
get them pushed over HTTP and a weight group. vLLM colocated: test_vllm.py.
"""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
from test_train import tiny_overrides

from plait import cli
from plait.config import load_config
from plait.train.guard import DIVERGED_EXIT, EngineDrift
from plait.train.loop import train


pytestmark = pytest.mark.slow


def noisy(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as a broken sync would leave it: the same shape, other values."""
    g = torch.Generator().manual_seed(0)
    return tensor + torch.randn(tensor.shape, generator=g).to(tensor.dtype) * tensor.float().std().to(tensor.dtype)


def committed(out) -> list[str]:
    return sorted(p.parent.name for p in (out / "checkpoints").glob("*/COMMITTED"))


def rounds_logged(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_hf_engine_sampling_from_other_weights_stops_the_run(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch, capsys
):
    """From round 3 on, the in-process engine's packed weight copies hold other values than the
    trainer's weights: round 3 stops `plait train` with exit code 3 and the reason; rounds 1-2
    and their checkpoints stand."""
    import plait.rollout.hf as hf

    real = hf.packed_linears
    rounds = {"n": 0}

    @contextlib.contextmanager
    def packed_from_other_weights(model, rows=64):
        rounds["n"] += 1
        if rounds["n"] < 3:
            with real(model, rows) as n:
                yield n
            return
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(noisy(p))
        try:
            with real(model, rows) as n:  # the copies are made from the noisy weights...
                with torch.no_grad():
                    for p, s in zip(model.parameters(), saved):
                        p.copy_(s)  # ...and the trainer keeps its own
                yield n
        finally:
            with torch.no_grad():
                for p, s in zip(model.parameters(), saved):
                    p.copy_(s)

    monkeypatch.setattr(hf, "packed_linears", packed_from_other_weights)
    out = tmp_path / "run"
    # through the command line, for its exit code: 3 (DIVERGED_EXIT), after the reason
    sets = tiny_overrides(tiny_model_path, prompts_jsonl, out, "checkpoint.save_steps=1")
    code = cli.main(["train", *(x for s in sets for x in ("--set", s))])
    said = capsys.readouterr().err
    assert code == DIVERGED_EXIT == 3, said[-2000:]
    assert re.search(r"round 3: the rollout engine's log-probs .* \(limit 0.01.*\(exit code 3\)", said), said[-2000:]
    assert committed(out) == ["step_00000001", "step_00000002"]
    assert rounds_logged(out) == [1, 2]


def test_the_hf_generation_process_given_corrupted_weights_stops_the_run(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch
):
    """The HF generation process (synchronous: generation_process=true) gets corrupted weights
    pushed after round 1: round 2 stops the run."""
    from plait.rollout.remote import RemoteEngine

    real = RemoteEngine.push_weights

    def corrupted_push(self, weights, version, *args, **kwargs):
        if version >= 1:
            weights = [(n, noisy(t)) for n, t in weights]
        return real(self, weights, version, *args, **kwargs)

    monkeypatch.setattr(RemoteEngine, "push_weights", corrupted_push)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_model_path, prompts_jsonl, out, "rollout.generation_process=true", "checkpoint.save_steps=1"
        ),
    )
    with pytest.raises(EngineDrift, match=r"round 2: "):
        train(cfg)
    assert committed(out) == ["step_00000001"]
    assert rounds_logged(out) == [1]
