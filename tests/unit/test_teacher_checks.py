"""On-policy distillation: the teacher's per-token advantage, against hand values and TRL's
IW-OPD loss; the checks that refuse a teacher that can't score the student's tokens."""

import ast
import socket
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from trl_source import trl_source

from plait.algo.advantages import teacher_advantages, with_teacher
from plait.algo.logprobs import selective_log_softmax
from plait.algo.losses import LossSettings, StepCounts, policy_loss
from plait.config import ConfigError, load_config, validate
from plait.train.update import signal_rows, why_nothing_is_skipped
from plait.types import Batch


def test_the_teacher_advantage_is_teacher_minus_student_on_loss_tokens():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -4.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-1.0, -0.2, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # by hand: 2 x (teacher - student), 0 off the mask
    want = torch.tensor([[1.0, -2.0, 0.0], [4.0, -0.2, -10.0]])
    assert torch.allclose(teacher_advantages(student, teacher, mask, weight=2.0), want)
    # beside the rewards' advantages: one per completion, broadcast over its tokens
    mixed = with_teacher(torch.tensor([0.5, -1.0]), student, teacher, mask, weight=2.0)
    assert torch.allclose(mixed, want + torch.tensor([[0.5], [-1.0]]))
    # ... or per token (REINFORCE++ with the KL in the reward)
    per_token = torch.full((2, 3), 0.25)
    assert torch.allclose(with_teacher(per_token, student, teacher, mask, 2.0), want + 0.25)


def test_the_teacher_advantage_carries_no_gradient():
    student = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = teacher_advantages(student, torch.tensor([[-0.5, -0.5]]), torch.ones(1, 2))
    assert not adv.requires_grad


def trl_iw_opd_loss():
    """TRL's IWOPDTrainer._compute_iw_opd_loss (trl/experimental/iw_opd) as a plain function,
    read from its source (importing TRL imports vLLM)."""
    src = trl_source("experimental/iw_opd/iw_opd_trainer")
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "IWOPDTrainer")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_iw_opd_loss")
    scope = {"torch": torch, "F": F}
    exec(textwrap.dedent(ast.get_source_segment(src, method)), scope)
    return scope["_compute_iw_opd_loss"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_gradient_equals_trls_on_policy_distillation_loss(temperature):
    """With iw_opd_gamma = 0 TRL's IW-OPD loss is plain on-policy distillation: -A_t log pi(y_t),
    A_t = teacher - student log-prob (no gradient), token mean. plait's clipped objective with the
    teacher's advantage, ratio 1 (one update per round), DAPO's token mean, has the same gradient."""
    torch.manual_seed(0)
    B, C, V = 3, 5, 11
    logits = torch.randn(B, C, V, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, C))
    mask = torch.ones(B, C, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    teacher = torch.log_softmax(torch.randn(B, C, V, dtype=torch.float64), -1).gather(-1, tokens[..., None])[..., 0]

    theirs = logits.clone().requires_grad_(True)
    fake = SimpleNamespace(
        temperature=temperature,
        iw_opd_gamma=0.0,
        iw_opd_epsilon=1e-8,
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
    )
    labels = tokens.masked_fill(mask == 0, -100)
    trl_iw_opd_loss()(fake, theirs, tokens, labels, teacher).backward()

    ours = logits.clone().requires_grad_(True)
    logp = selective_log_softmax(ours / temperature, tokens)
    old = logp.detach()
    adv = with_teacher(torch.zeros(B, dtype=torch.float64), old, teacher, mask, weight=1.0)
    counts = StepCounts(sequences=B, tokens=int(mask.sum()), micro_batches=1, max_completion_length=C)
    out = policy_loss(logp, old, adv, mask, counts, LossSettings(loss_type="dapo"))
    out.loss.backward()
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-12), (ours.grad - theirs.grad).abs().max()
    assert ours.grad.abs().sum() > 0  # a gradient to compare, not two zeros
    # the loss at ratio 1 is the mean over loss tokens of student - teacher: the reverse KL estimate
    assert torch.allclose(out.loss, ((old - teacher) * mask).sum() / mask.sum())


def test_with_a_teacher_every_row_with_a_loss_token_carries_a_gradient():
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    batch = Batch(torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4), mask, torch.zeros(3), 2)
    assert signal_rows(batch).tolist() == [False, False, False]
    batch.teacher_logprobs = torch.zeros(3, 2)
    assert signal_rows(batch).tolist() == [True, True, False]


# ---------------------------------------------------------------- plait check


def problems(tmp_path, *overrides):
    try:
        validate(load_config(None, [f"output_dir={tmp_path / 'run'}", *overrides]))
    except ConfigError as err:
        return err.problems
    return []


def test_a_teacher_allows_one_generation_and_no_reward(tiny_model_path, tmp_path):
    alone = (
        "rollout.num_generations=1",
        "rollout.prompts_per_step=16",
        "rewards=[]",
        f"model.name_or_path={tiny_model_path}",
    )
    found = problems(tmp_path, *alone)
    assert any("num_generations must be >= 2" in p for p in found) and any("rewards is empty" in p for p in found)
    assert "teacher.name_or_path" in " ".join(found)  # the refusal names the way out
    assert problems(tmp_path, *alone, f"teacher.name_or_path={tiny_model_path}") == []
    cfg = load_config(None, [f"teacher.name_or_path={tiny_model_path}"])
    assert why_nothing_is_skipped(cfg) == "the teacher's advantage is on every token"


def test_plait_check_refuses_a_missing_teacher(tiny_model_path, tmp_path):
    found = problems(tmp_path, f"model.name_or_path={tiny_model_path}", f"teacher.name_or_path={tmp_path / 'nope'}")
    assert len(found) == 1 and found[0].startswith("teacher.name_or_path: ") and "does not exist" in found[0]


def test_plait_check_refuses_a_teacher_with_another_vocabulary(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from plait.models import tiny_model

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.add_tokens(["<teacher-only>"])
    tok.save_pretrained(tmp_path / "vocab")
    other = tiny_model(tmp_path / "other", vocab_from=str(tmp_path / "vocab"))
    found = problems(tmp_path, f"model.name_or_path={tiny_model_path}", f"teacher.name_or_path={other}")
    assert len(found) == 1, found
    assert "the teacher's vocabulary differs from the student's" in found[0] and "<teacher-only>" in found[0]
    assert "must use the student's tokenizer" in found[0]


def test_plait_check_refuses_lora_adapters_and_teacher_lora(tiny_model_path, tmp_path):
    from peft import LoraConfig, get_peft_model

    from plait.models import load_model

    get_peft_model(load_model(str(tiny_model_path)), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "adapter"
    )
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    found = problems(tmp_path, f"model.name_or_path={tiny_model_path}", f"teacher.name_or_path={tmp_path / 'adapter'}")
    assert len(found) == 1 and "holds LoRA adapters" in found[0] and "merge_and_unload" in found[0], found
    found = problems(tmp_path, f"teacher.name_or_path={tiny_model_path}", "teacher.lora={r: 8}")
    assert found == [
        "'teacher.lora' is not an option: the teacher is frozen, so it trains no adapters; LoRA on the student is "
        "model.lora, and a teacher trained with LoRA is its run's final/ (plait exports merged weights); remove it"
    ]


def test_a_teacher_server_needs_its_url_and_a_url_needs_the_server_site(tiny_model_path, tmp_path):
    teacher = f"teacher.name_or_path={tiny_model_path}"
    assert problems(tmp_path, teacher, "teacher.site=server") == [
        "teacher.site=server needs teacher.url (the `plait rollout-server --model TEACHER` to ask)"
    ]
    assert problems(tmp_path, teacher, "teacher.url=http://127.0.0.1:8000") == [
        "teacher.url is set but teacher.site=trainer: set teacher.site=server to ask that server"
    ]
    assert problems(tmp_path, teacher, "teacher.site=server", "teacher.url=http://127.0.0.1:8000") == []


def test_a_teacher_server_that_never_answers_fails_with_where_and_how_to_start_it(tiny_model_path, monkeypatch):
    from plait.train.teacher import ServerTeacher, TeacherFailed

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PLAIT_ROLLOUT_TOKEN", "t" * 32)
    cfg = load_config(
        None,
        [
            f"teacher.name_or_path={tiny_model_path}",
            "teacher.site=server",
            f"teacher.url=http://127.0.0.1:{port}/",
            "rollout.vllm.connect_timeout_s=0.5",
        ],
    )
    with pytest.raises(TeacherFailed) as err:
        ServerTeacher(cfg)
    msg = str(err.value)
    assert f"no rollout server at http://127.0.0.1:{port} after" in msg and "the teacher's server" in msg
    assert "plait rollout-server --model TEACHER" in msg and "teacher.url" in msg
