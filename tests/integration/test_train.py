"""End-to-end training on a tiny random model: CLI, resume exactness, LoRA, KL, iterations."""

import json
import subprocess
import sys

import plait_test_rewards
import pytest
import torch
import yaml
from safetensors.torch import load_file

from plait.config import load_config
from plait.diff import hashes_by_round, metrics_by_round
from plait.models import native_bf16_cpu
from plait.train.loop import train


def tiny_overrides(model, data, out, *extra):
    train_f, eval_f = data
    return [
        f"model.name_or_path={model}",
        "data.task=null",
        f"data.path={train_f}",
        f"data.eval_path={eval_f}",
        "data.prompt_field=question",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=12",
        "train.micro_batch_size=4",
        "train.max_steps=4",
        "train.learning_rate=1e-3",
        "train.warmup_steps=2",
        "train.lr_scheduler=cosine",
        "train.decay_ratio=1.0",  # decay over every update after warmup: the tests' schedule arithmetic
        "train.precision=fp32",
        "rewards=[{name: 'plait_test_rewards:vowel_share'}]",
        "eval.before=false",
        "eval.after=false",
        "log.console=none",
        f"output_dir={out}",
        *extra,
    ]


def final_weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))


def sampled(run_dir, rounds) -> list[str]:
    """The `completions` record of each round (hashes.jsonl): the token ids sampled, whatever
    the process count."""
    hashes = hashes_by_round(run_dir)
    return [hashes[r]["completions"] for r in rounds]


def test_cli_train_end_to_end(tiny_model_path, prompts_jsonl, tmp_path, helper_env):
    out = tmp_path / "run"
    args = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        out,
        "eval.before=true",
        "eval.after=true",
        "checkpoint.save_steps=2",
        "log.console=plain",
        "train.lr_by_signal=false",  # the logged rate is the schedule's alone
    )
    cmd = [sys.executable, "-m", "plait.cli", "train", *sum((["--set", a] for a in args), [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=helper_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for key in (
        "reward/plait_test_rewards:vowel_share/mean",
        "reward/total/std",
        "accuracy",
        "completion/length_mean",
        "completion/truncated",
        "clip/fraction",
        "loss",
        "grad_norm",
        "lr",
        "time/generate",
        "time/score",
        "time/train",
    ):
        assert key in lines[0], key
    assert lines[0]["lr"] < lines[1]["lr"] and lines[3]["lr"] < lines[1]["lr"]  # warmup, then cosine decay
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in evals] == ["before", "after"] and evals[0]["n"] == 8
    assert (out / "config.yaml").is_file() and load_config(out / "config.yaml").train.max_steps == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    # the exported model is a normal HF folder, and training changed it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))
    assert "eval after" in proc.stdout and "boxed_accuracy:" in proc.stdout and "round    4" in proc.stdout


def crash_then_resume(model, data, tmp_path, *extra, reward="vowel_share", save_steps=2):
    """A run of 4 steps straight, and the same run crashed in step 3 (after the checkpoint of
    step 2) then resumed with resume=auto: (straight dir, crashed dir, the resumed run's result).
    `reward`: a plait_test_rewards function with a `{reward}_crashing` twin. save_steps=0: no
    checkpoint is due, the failing reward's own keeps steps 1-2."""
    extra = (*extra, f"rewards=[{{name: 'plait_test_rewards:{reward}'}}]")
    straight = tmp_path / "straight"
    train(load_config(None, tiny_overrides(model, data, straight, *extra)))

    crashed = tmp_path / "crashed"
    crash_cfg = load_config(
        None,
        tiny_overrides(
            model,
            data,
            crashed,
            *extra,
            f"checkpoint.save_steps={save_steps}",
            # on the trainer's thread, where the CALLS set below is seen
            f"rewards=[{{name: 'plait_test_rewards:{reward}_crashing', process: false}}]",
        ),
    )
    plait_test_rewards.CALLS.update(n=0, crash_at=3)  # the reward raises in round 3
    try:
        with pytest.raises(Exception, match="simulated crash"):
            train(crash_cfg)
    finally:
        plait_test_rewards.CALLS["crash_at"] = None
    assert (crashed / "checkpoints" / "step_00000002" / "COMMITTED").is_file()
    assert not (crashed / "final").exists()
    return straight, crashed, train(load_config(None, tiny_overrides(model, data, crashed, *extra, "resume=auto")))


def assert_resumed_exactly(straight, crashed) -> None:
    """The crashed-and-resumed run of crash_then_resume ends with the unbroken run's weights
    (torch.equal) and sampled the same tokens in each of its 4 rounds (generation hashes)."""
    a, b = final_weights(straight), final_weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    hashes = [[json.loads(line) for line in (d / "hashes.jsonl").read_text().splitlines()] for d in (straight, crashed)]
    by_round = [{h["round"]: h["generation"] for h in hs} for hs in hashes]
    assert sorted(by_round[0]) == [1, 2, 3, 4] and by_round[0] == by_round[1]


def test_a_failing_reward_keeps_the_rounds_before_it_and_the_resumed_run_is_exact(
    tiny_model_path, prompts_jsonl, tmp_path
):
    """No checkpoint is due (save_steps=0), and the reward raises in round 3: rounds 1-2 are
    checkpointed on the way out, and fixing it and resuming ends as the unbroken run, bit for bit."""
    straight, crashed, result = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path, save_steps=0)
    assert len(result.history) == 2  # rounds 3 and 4 only
    assert_resumed_exactly(straight, crashed)


def test_resume_after_a_crash_is_exact(tiny_model_path, prompts_jsonl, tmp_path):
    """4 steps straight == 2 steps, a crash in step 3, resume, 2 more steps: identical weights."""
    straight, crashed, result = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path)
    assert [m["loss"] for m in result.history] and len(result.history) == 2  # steps 3 and 4 only
    a, b = final_weights(straight), final_weights(crashed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    straight_losses = [json.loads(line)["loss"] for line in (straight / "metrics.jsonl").read_text().splitlines()]
    resumed_losses = [json.loads(line)["loss"] for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert resumed_losses == straight_losses  # steps 1, 2 (before the crash) then 3, 4


def test_a_lora_run_resumes_exactly(tiny_model_path, prompts_jsonl, tmp_path):
    """LoRA: the adapter, its optimizer state and the data position come back; the resumed run
    ends with the unbroken run's weights (the adapter merged in the final folder)."""
    straight, crashed, result = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path, "model.lora={r: 4}")
    assert len(result.history) == 2
    a, b = final_weights(straight), final_weights(crashed)
    start = load_file(str(tiny_model_path / "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a if k in start)  # the adapter trained
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


RESUME_CASES = {
    "moving KL reference": (["algo.beta=0.04", "algo.ref_model_sync_steps=1"], "vowel_share"),
    "bf16 autocast": (["train.precision=bf16"], "vowel_share"),
    "dynamic sampling": (["algo.dynamic_sampling=true"], "sometimes_constant"),
    "two-stage rounds": (["rollout.two_stage={first_generations: 2, keep: mixed, threshold: 0.3}"], "vowel_share"),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_is_exact_with(case, tiny_model_path, prompts_jsonl, tmp_path):
    """What a round carries beyond the weights comes back too: the reference model a moving KL
    mixes into (its weights and the updates since the last sync), bf16 autocast, dynamic
    sampling's refills and two-stage generation's kept groups. The resumed run samples, scores
    and weighs every round as the unbroken one and ends with its weights."""
    extra, reward = RESUME_CASES[case]
    straight, crashed, result = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path, *extra, reward=reward)
    assert len(result.history) == 2
    a, b = final_weights(straight), final_weights(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def by_round(runs, keys):  # {round: [values]} of each run
        return [{r: [x.get(k) for k in keys] for r, x in run.items()} for run in runs]

    m = [metrics_by_round(d) for d in (straight, crashed)]
    got, want = by_round(m, ("loss", "grad_norm", "reward/total/mean", "kl", "entropy"))
    assert got == want and sorted(got) == [1, 2, 3, 4]
    # scores are hashed with the reward's name, which the crashing twin changes
    got, want = by_round([hashes_by_round(d) for d in (straight, crashed)], ("generation", "advantages"))
    assert got == want
    rows, cfg = list(m[0].values()), yaml.safe_load((straight / "config.yaml").read_text())
    exercised = {  # the feature did its work in the rounds compared
        "moving KL reference": lambda: any(x["ref_syncs"] > 0 and x["kl"] > 0 for x in rows),
        "bf16 autocast": lambda: cfg["train"]["precision"] == "bf16",  # not resolved away to fp32
        "dynamic sampling": lambda: any(x["sampling/generated_groups"] > 2 for x in rows),
        "two-stage rounds": lambda: any(x["two_stage/prompts_skipped"] > 0 for x in rows),
    }[case]
    assert exercised(), (rows, cfg["train"])


def test_existing_run_dir_is_not_overwritten(tiny_model_path, prompts_jsonl, tmp_path):
    out = tmp_path / "run"
    train(
        load_config(
            None, tiny_overrides(tiny_model_path, prompts_jsonl, out, "train.max_steps=1", "train.warmup_steps=0")
        )
    )
    from plait.config import ConfigError

    with pytest.raises(ConfigError, match="already holds checkpoints.*--resume"):
        train(
            load_config(
                None, tiny_overrides(tiny_model_path, prompts_jsonl, out, "train.max_steps=1", "train.warmup_steps=0")
            )
        )


@pytest.mark.parametrize(
    "extra",
    [
        ["algo.beta=0.1", "algo.loss_type=grpo"],
        ["algo.num_iterations=2", "algo.loss_type=dr_grpo", "algo.epsilon_high=0.28"],
        ["model.lora={r: 4, alpha: 8}", "algo.beta=0.05", "algo.loss_type=bnpo"],
        ["train.precision=bf16", "algo.scale_rewards=batch"],
        ["algo.mask_truncated_completions=true"],
        ["rollout.precision=int8"],
    ],
    ids=["kl", "iterations", "lora", "bf16", "mask-truncated", "int8-rollouts"],
)
def test_variants_train(tiny_model_path, prompts_jsonl, tmp_path, extra):
    out = tmp_path / "run"
    result = train(load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, out, "train.max_steps=2", *extra)))
    assert len(result.history) == 2
    for m in result.history:
        assert all(v == v for v in m.values() if isinstance(v, float))  # no NaN anywhere
    if "algo.beta=0.1" in extra or "algo.beta=0.05" in extra:
        # the policy is the reference before the first update (LoRA: adapters start at zero), then moves
        assert result.history[0]["kl"] == pytest.approx(0.0, abs=1e-7) and result.history[1]["kl"] > 1e-7
    if "algo.mask_truncated_completions=true" in extra:
        # the random model never stops within 12 tokens: every completion is truncated, so nothing
        # is trained on and the weights stay the initial ones
        assert all(m["completion/truncated"] == 1.0 and m["grad_norm"] == 0.0 for m in result.history)
        start, end = load_file(str(tiny_model_path / "model.safetensors")), final_weights(out)
        assert all(torch.equal(start[k], end[k]) for k in start)
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    # rollouts sample in fp32 on a CPU unless told otherwise, bf16 training included, except on a CPU
    # with bf16 units, where they follow bf16 training (packed bf16 weights)
    bf16_rollouts = resolved["train"]["precision"] == "bf16" and native_bf16_cpu()
    want = "int8" if "rollout.precision=int8" in extra else "bf16" if bf16_rollouts else "fp32"
    assert resolved["rollout"]["precision"] == want
    if "rollout.precision=int8" in extra:
        # int8 samples from a coarser policy: the correction is on by default, and the gap it weighs is
        # measured every round, above fp32 rounding yet under the int8 drift limit (the guard stayed quiet)
        assert resolved["algo"]["engine_is_correction"] is True
        assert all(1e-4 < m["logprob_gap"] < 2.0 and m["engine/kl"] > 0 for m in result.history)
    if "algo.num_iterations=2" in extra:
        # the second pass is against the old log-probs of a policy one update behind: ratio != 1
        assert all(abs(m["ratio/mean"] - 1.0) > 1e-6 for m in result.history)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")  # LoRA runs export merged weights
    if any(e.startswith("model.lora") for e in extra):
        assert (out / "final" / "adapter" / "adapter_config.json").is_file()


def test_evaluation_in_a_run_and_plait_eval_decode_in_the_trainers_precision(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch, capsys
):
    """With int8 rollouts (HF engine in the trainer's process), the run's evaluations before and
    after and `plait eval` of the run go through that same int8 engine, yet every forward pass
    of theirs decodes in `train.precision` (fp32), while the round's sampling decodes in int8.
    Seen where the engine picks its precision for a generate call (`HFEngine._packed`)."""
    import plait.evaluate
    import plait.train.loop
    from plait.cli import main
    from plait.rollout.hf import HFEngine

    calls, evaluating = [], []  # (evaluating?, the engine's own precision, the precision it decodes in)
    packed = HFEngine._packed

    def spy(self, model, precision):
        calls.append((bool(evaluating), self.precision, precision))
        return packed(self, model, precision)

    def during_evaluation(evaluate):
        def wrapped(*args, **kwargs):
            evaluating.append(True)
            try:
                return evaluate(*args, **kwargs)
            finally:
                evaluating.pop()

        return wrapped

    monkeypatch.setattr(HFEngine, "_packed", spy)
    monkeypatch.setattr(plait.train.loop, "evaluate", during_evaluation(plait.train.loop.evaluate))
    monkeypatch.setattr(plait.evaluate, "evaluate", during_evaluation(plait.evaluate.evaluate))  # plait eval's
    out = tmp_path / "run"
    extra = ["train.max_steps=1", "train.warmup_steps=0", "rollout.precision=int8", "eval.before=true"]
    train(load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, out, *extra, "eval.after=true")))
    in_the_run = list(calls)
    assert [json.loads(line)["tag"] for line in (out / "eval.jsonl").read_text().splitlines()] == ["before", "after"]
    assert {c for c in in_the_run if not c[0]} == {(False, "int8", "int8")}  # the round samples in int8
    assert {c for c in in_the_run if c[0]} == {(True, "int8", "fp32")}  # both evaluations decode in fp32
    del calls[:]
    assert main(["eval", str(out)]) == 0
    assert "boxed_accuracy: " in capsys.readouterr().out
    assert set(calls) == {(True, "int8", "fp32")}  # the run's int8 engine, decoding in the run's fp32


def test_cli_eval_scores_a_model_folder(tiny_model_path, prompts_jsonl, helper_env, capsys):
    """`plait eval` of a model folder (its command, in this process), and of a missing one (a
    process of its own: the message and the exit code a user sees)."""
    from plait.cli import main

    train_f, eval_f = prompts_jsonl
    sets = [
        "data.task=null",
        f"data.path={train_f}",
        f"data.eval_path={eval_f}",
        "data.prompt_field=question",
        "rollout.max_completion_length=8",
    ]
    assert main(["eval", str(tiny_model_path), "--show", "1", *(x for a in sets for x in ("--set", a))]) == 0
    assert "boxed_accuracy: 0.000 on 8 prompts" in capsys.readouterr().out  # a random model never boxes the sum
    missing = subprocess.run(
        [sys.executable, "-m", "plait.cli", "eval", "/no/such/model"], capture_output=True, text=True, env=helper_env
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_a_reward_returning_inf_stops_the_run_before_its_update(
    tiny_model_path, prompts_jsonl, tmp_path, monkeypatch, capsys
):
    """A reward that returns inf in round 3 stops `plait train` with exit code 2 and a message that
    names the reward, the completion and the rule, before round 3 updates anything: the metrics end
    at round 2 and round 2's checkpoint stays committed and loadable."""
    out = tmp_path / "run"
    args = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        out,
        "train.max_steps=4",
        "checkpoint.save_steps=1",
        "checkpoint.async_save=false",
        "rewards=[{name: 'plait_test_rewards:vowel_share_inf_env'}]",
    )
    from plait.cli import main

    monkeypatch.setenv("PLAIT_TEST_INF_CALL", "3")
    assert main(["train", *(x for a in args for x in ("--set", a))]) == 2
    err = capsys.readouterr().err
    assert "reward 'plait_test_rewards:vowel_share_inf_env' returned inf for completion 0" in err, err[-3000:]
    assert "rewards must be finite" in err
    monkeypatch.delenv("PLAIT_TEST_INF_CALL")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    committed = sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMMITTED").is_file())
    assert committed[-1] == "step_00000002"
    result = train(load_config(None, [*args, "train.max_steps=2", "resume=auto"]))
    assert result.history == []  # resumed at round 2: nothing left to run, the checkpoint loads


def test_keep_best_keeps_the_best_evaluated_model(tiny_model_path, prompts_jsonl, tmp_path, monkeypatch):
    """checkpoint.keep_best: RUN_DIR/best holds the model of the best evaluation (here the one
    after round 2 of 0.1, 0.6, 0.3, 0.2), with best.json naming the round: a run that peaks and
    degrades keeps its peak."""
    import plait.train.loop as loop
    from plait.evaluate import EvalResult

    scores = iter([0.1, 0.6, 0.3, 0.2])

    def fake_evaluate(program, engine, prompts, metric, tokens, stop):
        return EvalResult(next(scores), 10)

    monkeypatch.setattr(loop, "evaluate", fake_evaluate)
    out = tmp_path / "run"
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_model_path,
            prompts_jsonl,
            out,
            "checkpoint.keep_best=true",
            "eval.before=true",
            "eval.after=true",
            "eval.every_steps=2",
            "checkpoint.save_steps=2",
            "checkpoint.keep_last=5",
        ),
    )
    loop.train(cfg)
    assert json.loads((out / "best" / "best.json").read_text()) == {"round": 2, "step": 2, "boxed_accuracy": 0.6}
    best = load_file(str(out / "best" / "model.safetensors"))
    at_2 = load_file(str(out / "checkpoints" / "step_00000002" / "model.safetensors"))
    shared = [k for k in at_2 if k in best]
    assert shared and all(torch.equal(best[k], at_2[k]) for k in shared)  # the weights after step 2
    assert not (out / "best.tmp").exists()
