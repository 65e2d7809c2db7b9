"""On-policy distillation on tiny random models: the teacher's log-probs wherever it runs, an
update that moves the student toward it, runs with it (alone, LoRA, async), and a teacher that
dies mid-run."""

import json

import plait_test_rewards
import pytest
import torch
from test_train import final_weights, tiny_overrides

from plait.algo.logprobs import positions
from plait.algo.losses import top_k_distillation
from plait.compare import compare, describe
from plait.config import load_config
from plait.models import load_model
from plait.train.backends.local import LocalBackend
from plait.train.loop import train
from plait.train.teacher import HeldTeacher, ProcessTeacher, TeacherFailed
from plait.train.update import logprob_prepass, policy_update, sequence_logprobs
from plait.types import Batch


def sampled_batch(seed=0) -> Batch:
    """Three groups of two completions after left-padded prompts, the last completions
    right-padded: the shapes a round's batch has (packing puts each group in one row)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len, width = 6, 5
    ids = torch.randint(10, 2000, (6, prompt_len + width), generator=g)
    for group in range(3):  # a group's completions share its prompt
        ids[2 * group + 1, :prompt_len] = ids[2 * group, :prompt_len]
    attention = torch.ones_like(ids)
    attention[2:4, :2] = 0  # a shorter prompt
    completion = torch.ones(6, width, dtype=torch.long)
    completion[1, 3:] = completion[4, 2:] = 0  # shorter completions
    attention[:, prompt_len:] = completion
    return Batch(ids, attention, completion, torch.zeros(6), prompt_len, sampling_logprobs=torch.zeros(6, width))


def test_the_teachers_logprobs_equal_the_references_wherever_it_runs(tiny_model_path, teacher_model_path, tmp_path):
    """The teacher's log-probs of the sampled tokens are the same model's log-probs computed as
    the reference model's are (plait's log-prob prepass with beta > 0): bit for bit when the
    training process holds it, within 1e-6 from its own process (the same code in another
    process)."""
    cfg = load_config(
        None,
        [
            f"teacher.name_or_path={teacher_model_path}",
            "algo.beta=0.04",
            "train.micro_batch_size=4",
            "rollout.temperature=0.8",
            f"output_dir={tmp_path}",
        ],
    )
    teacher = load_model(str(teacher_model_path)).eval().requires_grad_(False)
    backend = LocalBackend.wrap(load_model(str(tiny_model_path)), ref_model=teacher)
    backend.teacher_model = teacher
    batch = sampled_batch()
    logprob_prepass(batch, cfg, backend)  # the reference's log-probs, as a run computes them
    held = HeldTeacher(cfg, backend).logprobs(batch)
    assert torch.equal(held * batch.completion_mask, batch.ref_logprobs * batch.completion_mask)
    own = ProcessTeacher(cfg, torch.device("cpu"))
    try:
        far = own.logprobs(batch)
    finally:
        own.close()
    assert own.process.poll() == 0  # closed: the process ended on its own
    real = batch.completion_mask.bool()
    assert torch.allclose(far[real], held[real], atol=1e-6, rtol=0), (far - held)[real].abs().max()
    assert held[real].abs().min() > 0  # log-probs of real tokens, not zeros


def test_one_update_moves_the_student_toward_the_teacher(tiny_model_path, teacher_model_path, tmp_path):
    """After one update on a batch the teacher scored, the student's log-probs of those tokens
    moved the way the teacher's advantage points: up where the teacher finds a token likelier,
    down where it finds it less likely (the advantage-weighted change is positive), and they are
    closer to the teacher's (squared gap). The logged teacher/kl is the mean gap before it."""
    cfg = load_config(
        None,
        [
            f"teacher.name_or_path={teacher_model_path}",
            "train.micro_batch_size=4",
            "train.learning_rate=1e-4",
            "train.warmup_steps=0",
            "train.max_steps=1",
            f"output_dir={tmp_path}",
        ],
    )
    backend = LocalBackend(cfg, torch.device("cpu"))
    backend.load(cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(tiny_model_path)})}))
    batch = sampled_batch(seed=1)
    batch.teacher_logprobs = HeldTeacher(cfg, backend).logprobs(batch)
    mask = batch.completion_mask.float()
    with torch.no_grad():
        before = sequence_logprobs(backend.module, batch, 1.0).float()
    metrics = policy_update(batch, cfg, backend)
    with torch.no_grad():
        after = sequence_logprobs(backend.module, batch, 1.0).float()
    advantage = (batch.teacher_logprobs - before) * mask
    assert float((advantage * (after - before)).sum()) > 0
    kl = float(((before - batch.teacher_logprobs) * mask).sum() / mask.sum())
    assert metrics["teacher/kl"] == pytest.approx(kl, abs=1e-5)
    gap = [float((((lp - batch.teacher_logprobs) * mask) ** 2).sum()) for lp in (before, after)]
    assert gap[1] < gap[0]  # closer to the teacher's log-probs on those tokens


def test_the_teachers_top_k_wherever_it_runs_and_the_students_logprobs_of_them(
    tiny_model_path, teacher_model_path, tmp_path
):
    """teacher.top_k: the teacher names its k likeliest tokens at each completion position with
    their log-probs (those of a full log-softmax of its logits, within 1e-5) from the pass that
    gives its sampled-token log-probs (those torch.equal to teacher.top_k=0's), the same from its
    own process (ids equal, log-probs within 1e-6); the student reads its own log-probs of those
    tokens through every way a micro-batch goes through the model (padded, packed, packed through
    the wrapper's forward) within 1e-5 of the same full log-softmax, and the sampled tokens'
    log-probs beside them are those it computes without them (torch.equal)."""
    k = 4
    cfg = load_config(
        None,
        [f"teacher.name_or_path={teacher_model_path}", f"teacher.top_k={k}", "train.micro_batch_size=4"]
        + ["rollout.temperature=0.8", f"output_dir={tmp_path}"],
    )
    teacher = load_model(str(teacher_model_path)).eval().requires_grad_(False)
    student = load_model(str(tiny_model_path)).eval().requires_grad_(False)
    backend = LocalBackend.wrap(student)
    backend.teacher_model = teacher
    batch = sampled_batch()
    real = batch.completion_mask.bool()

    def full(model):  # every completion position's log-softmax at the sampling temperature
        position_ids = positions(batch.attention_mask)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
        return (logits[:, batch.prompt_len - 1 : -1].float() / 0.8).log_softmax(-1)

    sampled, ids, values = HeldTeacher(cfg, backend).top_logprobs(batch)
    with torch.no_grad():
        want = full(teacher).topk(k, -1)
    assert torch.equal(ids[real], want.indices[real])
    assert torch.allclose(values[real], want.values[real], atol=1e-5, rtol=0)
    assert torch.equal(sampled, HeldTeacher(cfg, backend).logprobs(batch))  # the same pass reads both
    own = ProcessTeacher(cfg, torch.device("cpu"))
    try:
        far = own.top_logprobs(batch)
    finally:
        own.close()
    assert torch.equal(far[1][real], ids[real])
    assert torch.allclose(far[2][real], values[real], atol=1e-6, rtol=0)

    with torch.no_grad():
        student_full = full(student).gather(-1, ids)
        for sharing in (None, "parts", "forward"):
            both = sequence_logprobs(student, batch, 0.8, sharing=sharing, extra=ids)
            assert both.shape == (*batch.completion_mask.shape, 1 + k)
            assert torch.equal(both[..., 0], sequence_logprobs(student, batch, 0.8, sharing=sharing)), sharing
            assert torch.allclose(both[..., 1:][real], student_full[real], atol=1e-5, rtol=0), sharing


def test_one_top_k_update_moves_the_students_distribution_toward_the_teachers(
    tiny_model_path, teacher_model_path, tmp_path
):
    """With teacher.top_k, one update (no reward) lowers the forward KL from the teacher's top k
    to the student at the batch's positions; the logged teacher/top_k_kl is its token mean before."""
    cfg = load_config(
        None,
        [f"teacher.name_or_path={teacher_model_path}", "teacher.top_k=8", "train.micro_batch_size=4"]
        + ["train.learning_rate=1e-3", "train.warmup_steps=0", "train.max_steps=1", f"output_dir={tmp_path}"],
    )
    backend = LocalBackend(cfg, torch.device("cpu"))
    backend.load(cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(tiny_model_path)})}))
    batch = sampled_batch(seed=2)
    batch.teacher_logprobs, batch.teacher_top_ids, batch.teacher_top_logprobs = HeldTeacher(cfg, backend).top_logprobs(
        batch
    )
    mask = batch.completion_mask.float()

    def kl() -> float:
        with torch.no_grad():
            top = sequence_logprobs(backend.module, batch, 1.0, extra=batch.teacher_top_ids)[..., 1:]
        return float((top_k_distillation(top, batch.teacher_top_logprobs) * mask).sum() / mask.sum())

    before = kl()
    metrics = policy_update(batch, cfg, backend)
    assert metrics["teacher/top_k_kl"] == pytest.approx(before, abs=1e-5)
    assert kl() < before
    assert metrics["grad_norm"] > 0  # the rewards' advantages are all 0: the teacher's term moved it


RUNS = {
    "teacher alone, one completion per prompt": [
        "rollout.num_generations=1",
        "rollout.prompts_per_step=8",
        "rewards=[]",
    ],
    "beside a reward, LoRA student": ["model.lora={r: 4}", "teacher.weight=0.5"],
    "async rounds, teacher in its own process": ["rollout.max_staleness=1", "teacher.site=process"],
    "its top k in its own process, no reward": ["teacher.top_k=8", "teacher.site=process", "rewards=[]"],
}


@pytest.mark.parametrize("case", list(RUNS))
def test_a_run_with_a_teacher(case, tiny_model_path, teacher_model_path, prompts_jsonl, tmp_path):
    """The teacher scores every round's samples, whatever sampled them: its KL is logged each
    round, its time is a phase of its own, and every completion carries a gradient."""
    out = tmp_path / "run"
    result = train(
        load_config(
            None,
            tiny_overrides(
                tiny_model_path, prompts_jsonl, out, f"teacher.name_or_path={teacher_model_path}", *RUNS[case]
            ),
        )
    )
    rows = result.history
    assert len(rows) == 4
    assert all(m["teacher/kl"] != 0 and m["time/teacher"] > 0 for m in rows)
    assert all(m["update/skipped_rows"] == 0 and m["update/signal_share"] == 1.0 for m in rows)
    assert all((m.get("teacher/top_k_kl", 0) > 0) == ("top k" in case) for m in rows)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["teacher/kl"] for m in logged] == [m["teacher/kl"] for m in rows]
    if case == next(iter(RUNS)):  # plait compare shows it per round, among its headline metrics
        summary, _ = compare([out], tmp_path / "compare")
        (group,) = summary["groups"].values()
        assert sorted(group["rounds"]["teacher/kl"]) == [1, 2, 3, 4]
        assert "  teacher/kl " in describe(summary)


def test_a_teacher_that_dies_stops_the_run_and_the_resumed_run_ends_as_the_unbroken_one(
    tiny_model_path, teacher_model_path, prompts_jsonl, tmp_path
):
    """The teacher's own process is killed (SIGKILL) in round 3: the run stops with what happened
    and how to resume, rounds 1-2 kept in a checkpoint; resumed with resume=auto, it ends with
    the unbroken run's weights (torch.equal) and the same KL to the teacher every round."""
    extra = (f"teacher.name_or_path={teacher_model_path}", "teacher.site=process", "teacher.weight=0.5")
    reward = "rewards=[{name: 'plait_test_rewards:vowel_share_killing_teacher', process: false}]"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, straight, *extra, reward)))
    plait_test_rewards.CALLS["crash_at"] = 3
    try:
        with pytest.raises(TeacherFailed) as stop:
            train(load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, crashed, *extra, reward)))
    finally:
        plait_test_rewards.CALLS["crash_at"] = None
    message = str(stop.value)
    assert message.startswith("round 3: the teacher's process (pid ") and "died (exit code -9)" in message, message
    assert "fix the teacher; then resume=auto continues from the last checkpoint (round 2)" in message
    assert not (crashed / "final").exists()
    result = train(
        load_config(None, tiny_overrides(tiny_model_path, prompts_jsonl, crashed, *extra, reward, "resume=auto"))
    )
    assert len(result.history) == 2  # rounds 3 and 4
    a, b = final_weights(straight), final_weights(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    kl = [
        [json.loads(line)["teacher/kl"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (straight, crashed)
    ]
    assert kl[0] == kl[1] and len(kl[0]) == 4
