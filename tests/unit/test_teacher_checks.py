"""On-policy distillation: the teacher's per-token advantage, against hand values and TRL's
IW-OPD loss; the checks that refuse a teacher that can't score the student's tokens."""

import ast
import json
import math
import shutil
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
from plait.algo.losses import LossSettings, StepCounts, policy_loss, top_k_distillation
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


def test_the_top_k_distillation_term_is_the_forward_kl_from_the_renormalized_top_k():
    """By hand: teacher probabilities 0.5 and 0.25 on its top 2 renormalize to 2/3 and 1/3; a
    student with 0.4 and 0.1 on those tokens is 2/3 ln((2/3)/0.4) + 1/3 ln((1/3)/0.1) away."""
    teacher = torch.tensor([[[0.5, 0.25]]]).log()
    student = torch.tensor([[[0.4, 0.1]]]).log().requires_grad_(True)
    want = 2 / 3 * math.log((2 / 3) / 0.4) + 1 / 3 * math.log((1 / 3) / 0.1)
    kl = top_k_distillation(student, teacher)
    assert kl.shape == (1, 1) and float(kl.detach()) == pytest.approx(want, rel=1e-6)
    kl.sum().backward()  # d/d log p_s(v) = -q(v): every top-k token is pulled up by its share
    assert torch.allclose(student.grad, -torch.tensor([[[2 / 3, 1 / 3]]]))
    # 0 where the student puts the teacher's renormalized probabilities on its top k, and never below
    assert float(top_k_distillation(torch.tensor([[[2 / 3, 1 / 3]]]).log(), teacher)) == pytest.approx(0, abs=1e-7)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        full = torch.randn(3, 4, 50, generator=g).log_softmax(-1)
        top = torch.randn(3, 4, 50, generator=g).log_softmax(-1).topk(5, -1)
        assert (top_k_distillation(full.gather(-1, top.indices), top.values) >= 0).all()


def trl_gkd_loss():
    """TRL's GKDTrainer.generalized_jsd_loss (trl/experimental/gkd) as a plain function, from its source."""
    src = trl_source("experimental/gkd/gkd_trainer")
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "GKDTrainer")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "generalized_jsd_loss")
    scope = {"torch": torch, "F": F}
    exec(textwrap.dedent(ast.get_source_segment(src, method)).replace("@staticmethod\n", ""), scope)
    return scope["generalized_jsd_loss"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_top_k_term_over_the_whole_vocabulary_is_trls_gkd_loss_at_beta_0(temperature):
    """With k = the vocabulary size nothing is renormalized away, and the top-k term, a token mean
    over the loss tokens, is TRL's GKD loss with beta = 0 (the forward KL, masked by the labels,
    batchmean): the same value and the same gradient on the student's logits."""
    torch.manual_seed(1)
    B, C, V = 3, 5, 11
    student, teacher = torch.randn(B, C, V, dtype=torch.float64), torch.randn(B, C, V, dtype=torch.float64)
    mask = torch.ones(B, C, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    labels = torch.randint(0, V, (B, C)).masked_fill(mask == 0, -100)

    theirs = student.clone().requires_grad_(True)
    want = trl_gkd_loss()(theirs, teacher, labels, beta=0.0, temperature=temperature)
    want.backward()

    ours = student.clone().requires_grad_(True)
    top = (teacher / temperature).log_softmax(-1).topk(V, -1)
    student_top = (ours / temperature).log_softmax(-1).gather(-1, top.indices)
    got = (top_k_distillation(student_top, top.values) * mask).sum() / mask.sum()
    got.backward()
    assert torch.allclose(got, want, atol=1e-12, rtol=0), float((got - want).detach())
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-12, rtol=0), (ours.grad - theirs.grad).abs().max()
    assert float(want.detach()) > 0 and ours.grad.abs().sum() > 0


def test_a_top_k_a_teacher_server_cannot_name_is_refused_with_the_sites_that_can(tiny_model_path, tmp_path):
    teacher, server = f"teacher.name_or_path={tiny_model_path}", ("teacher.site=server", "teacher.url=http://h:8000")
    assert problems(tmp_path, teacher, *server, "teacher.top_k=21") == [
        "teacher.top_k=21 with teacher.site=server: a vLLM replica names at most 20 likeliest tokens a position "
        "(its max_logprobs); set teacher.top_k <= 20, or hold the teacher in the trainer (teacher.site=trainer) "
        "or its own process (process)"
    ]
    assert problems(tmp_path, teacher, *server, "teacher.top_k=20") == []
    small = tmp_path / "small-head"  # a teacher whose config says 16 tokens
    shutil.copytree(tiny_model_path, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 16}))
    said = problems(tmp_path, f"teacher.name_or_path={small}", "teacher.top_k=17")
    assert "teacher.top_k=17 is more than the teacher's 16 tokens: set teacher.top_k <= 16" in said
    assert not any("top_k" in p for p in problems(tmp_path, f"teacher.name_or_path={small}", "teacher.top_k=16"))
    for site in ("trainer", "process"):
        assert problems(tmp_path, teacher, f"teacher.site={site}", "teacher.top_k=64") == []


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
