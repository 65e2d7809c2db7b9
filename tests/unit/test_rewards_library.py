"""The reward library: tag_count, reasoning_steps, cosine_length, repetition_penalty, reward_model.

Expected values are worked by hand from each function's formula.
"""

import math
import shutil

import pytest

from plait.rewards import BUILTIN, resolve_reward
from plait.rewards.format import reasoning_steps, tag_count
from plait.rewards.length import cosine_length
from plait.rewards.model import reward_model
from plait.rewards.repetition import repetition_penalty
from plait.rewards.runner import BoundReward, score_groups
from plait.types import Completion, Group, Prompt


@pytest.mark.parametrize(
    "name, fn",
    [
        ("tag_count", tag_count),
        ("reasoning_steps", reasoning_steps),
        ("cosine_length", cosine_length),
        ("repetition_penalty", repetition_penalty),
        ("reward_model", reward_model),
    ],
)
def test_registered_as_builtins(name, fn):
    assert BUILTIN[name] is fn
    assert resolve_reward(name) is fn
    assert fn.__doc__ and len(fn.__doc__) > 100  # formula and source


# ---------------------------------------------------------------- tag_count


def test_tag_count_partial_credit():
    full = "<think>\nadd the units\n</think>\n<answer>\n42\n</answer>"
    think_only = "<think>\nadd the units\n</think>\n42"
    doubled = "<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n1\n</answer>"  # both think markers twice
    answer_only = "\n<answer>\n42\n</answer>"
    no_newlines = "<think>a</think><answer>b</answer>"
    got = tag_count([full, think_only, doubled, answer_only, no_newlines, ""])
    assert got == [1.0, 0.5, 0.5, 0.5, 0.0, 0.0]


# ---------------------------------------------------------------- reasoning_steps


def test_reasoning_steps_counts_markers():
    texts = [
        "Step 1: add. Step 2: carry. Step 3: done.",  # 3 -> 1
        "First, add the units. Then carry.",  # 1 ("Then" is not a marker)
        "1. add\n2. carry",  # 2 numbered lines
        "- a\n* b\n  - c\nFinally, 7",  # 3 bullets + Finally = 4 -> capped at 1
        "3.14 is pi, x - y and a*b",  # a decimal and inline symbols are not steps
        "1. First, add",  # numbered line + transition word = 2
        "",
    ]
    assert reasoning_steps(texts) == [1.0, 1 / 3, 2 / 3, 1.0, 0.0, 2 / 3, 0.0]
    assert reasoning_steps(texts[:4], expected_steps=5) == [3 / 5, 1 / 5, 2 / 5, 4 / 5]
    assert reasoning_steps(["Next, go"], expected_steps=1) == [1.0]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_reasoning_steps_validates(bad):
    with pytest.raises(ValueError, match=r"expected_steps must be an integer >= 1"):
        reasoning_steps(["x"], expected_steps=bad)


# ---------------------------------------------------------------- cosine_length


def _ids(n):
    return [0] * n


def test_cosine_length_by_hand():
    # defaults: wrong -1 (L=0) .. -0.5 (L=max); correct 1 (L=0) .. 0.5 (L=max); max_length 256
    lengths = [0, 64, 128, 256, 1000]
    n = len(lengths)
    right = cosine_length(["\\boxed{81}"] * n, completion_ids=[_ids(k) for k in lengths], answer=["81"] * n)
    wrong = cosine_length(["\\boxed{80}"] * n, completion_ids=[_ids(k) for k in lengths], answer=["81"] * n)
    # correct: 0.5 + 0.25 * (1 + cos(pi L / 256)); cos = 1, sqrt(2)/2, 0, -1, -1 (clipped)
    assert right == pytest.approx([1.0, 0.75 + math.sqrt(2) / 8, 0.75, 0.5, 0.5], abs=1e-12)
    # wrong: -0.5 - 0.25 * (1 + cos(pi L / 256))
    assert wrong == pytest.approx([-1.0, -0.75 - math.sqrt(2) / 8, -0.75, -0.5, -0.5], abs=1e-12)


def test_cosine_length_custom_values_and_missing_answer():
    kw = dict(min_value_wrong=-2.0, max_value_wrong=0.0, min_value_correct=0.0, max_value_correct=2.0, max_length=100)
    got = cosine_length(
        ["\\boxed{3}", "\\boxed{4}", "\\boxed{3}", "\\boxed{3}"],
        completion_ids=[_ids(50), _ids(50), _ids(0), _ids(7)],
        answer=["3", "3", "3", None],
        **kw,
    )
    # L=50 of 100: cos = 0, so the midpoint of each range; no answer -> not applicable
    assert got == pytest.approx([1.0, -1.0, 2.0, None], abs=1e-12)


def test_cosine_length_none_passes_the_runner():
    p = Prompt(0, "What is 1 + 1?", [1], None)
    groups = [Group(p, [Completion(0, [3, 4], "\\boxed{2}", [0.0, 0.0], False, "eos")])]
    score_groups(groups, [BoundReward("cosine_length", cosine_length, 1.0, {"max_length": 4})])
    assert groups[0].rewards == {"cosine_length": [None]}
    assert groups[0].total == [0.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_length": 0}, r"max_length must be an integer >= 1, got 0"),
        ({"max_length": 2.5}, r"max_length must be an integer >= 1"),
        ({"min_value_correct": 1.5}, r"min_value_correct must be <= max_value_correct"),
        ({"min_value_wrong": 0.0}, r"min_value_wrong must be <= max_value_wrong"),
        ({"max_value_wrong": 0.7, "min_value_wrong": 0.6}, r"max_value_wrong must be <= min_value_correct"),
        ({"max_value_correct": math.inf}, r"max_value_correct must be a finite number"),
        ({"min_value_wrong": "low"}, r"min_value_wrong must be a finite number"),
    ],
)
def test_cosine_length_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cosine_length(["\\boxed{1}"], completion_ids=[[1]], answer=["1"], **kwargs)


# ---------------------------------------------------------------- repetition_penalty


def test_repetition_penalty_by_hand():
    texts = [
        "a b c a b c",  # trigrams abc bca cab abc: 3 unique of 4 -> (1 - 3/4) * -1
        "A b C a B c",  # lowercased: the same
        "a b c d",  # no repeat
        "a b c",  # one trigram
        "a b",  # fewer words than ngram_size
        "",
        "a a a a a",  # aaa x3: 1 unique of 3
    ]
    assert repetition_penalty(texts) == pytest.approx([-0.25, -0.25, 0.0, 0.0, 0.0, 0.0, -2 / 3], abs=1e-12)
    assert repetition_penalty(["a a a a a", "a b c a b c"], ngram_size=1) == pytest.approx([-(1 - 1 / 5), -(1 - 3 / 6)])
    assert repetition_penalty(["a b c a b c"], max_penalty=-2.0) == pytest.approx([-0.5])
    assert repetition_penalty(["a b c a b c"], max_penalty=0) == [0.0]
    assert str(repetition_penalty(["a b c d"])[0]) == "0.0"  # not -0.0 in the logs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_penalty": 0.5}, r"max_penalty must be a finite number <= 0, got 0.5"),
        ({"max_penalty": -math.inf}, r"max_penalty must be a finite number <= 0"),
        ({"ngram_size": 0}, r"ngram_size must be an integer >= 1, got 0"),
        ({"ngram_size": 2.0}, r"ngram_size must be an integer >= 1"),
    ],
)
def test_repetition_penalty_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        repetition_penalty(["a b c"], **kwargs)


# ---------------------------------------------------------------- reward_model


@pytest.fixture(scope="module")
def tiny_rm_path(tiny_model_path, tmp_path_factory):
    """A random 2-layer Llama reward model (one logit) with the bundled model's tokenizer.

    The config has no pad_token_id, so reward_model must set it from the tokenizer.
    """
    from transformers import LlamaForSequenceClassification

    from plait.models import tiny_model

    return tiny_model(
        tmp_path_factory.mktemp("rm") / "model",
        vocab_from=str(tiny_model_path),
        model_class=LlamaForSequenceClassification,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        max_position_embeddings=512,
        num_labels=1,
        initializer_range=0.2,  # large enough that inputs get clearly different scores
        pad_token_id=None,
    )


PROMPTS = ["What is 2 + 2?", "Name a colour.", "What is 2 + 2?", "Say hi."]
COMPLETIONS = ["4", "Blue, the colour of a clear sky at noon, which is a long answer.", "4", "hi"]


def _direct_scores(path, prompts, completions):
    """Each input scored alone (batch of 1, no padding) by the model itself."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for p, c in zip(prompts, completions):
        if tok.chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(p + c)["input_ids"]
        with torch.inference_mode():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


def test_reward_model_matches_unpadded_scores(tiny_rm_path):
    got = reward_model(COMPLETIONS, prompts=PROMPTS, path=str(tiny_rm_path))
    assert len(got) == len(COMPLETIONS)
    assert all(isinstance(v, float) and math.isfinite(v) for v in got)
    assert got[0] == got[2]  # identical inputs, identical scores
    assert len({round(v, 4) for v in (got[0], got[1], got[3])}) == 3  # the model does tell inputs apart
    # batched with inputs of very different lengths (padding) == each alone, unpadded
    assert got == pytest.approx(_direct_scores(tiny_rm_path, PROMPTS, COMPLETIONS), abs=1e-4)
    # batch size changes nothing; scale multiplies
    assert reward_model(COMPLETIONS, prompts=PROMPTS, path=tiny_rm_path, batch_size=1) == pytest.approx(got, abs=1e-4)
    doubled = reward_model(COMPLETIONS, prompts=PROMPTS, path=tiny_rm_path, batch_size=3, scale=2.0)
    assert doubled == pytest.approx([2 * v for v in got], abs=2e-4)
    assert reward_model([], prompts=[], path=tiny_rm_path) == []


def test_reward_model_is_loaded_once_and_thread_safe(tiny_rm_path):
    from concurrent.futures import ThreadPoolExecutor

    from plait.rewards import model as rm

    first = reward_model(COMPLETIONS, prompts=PROMPTS, path=tiny_rm_path)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: reward_model(COMPLETIONS, prompts=PROMPTS, path=tiny_rm_path), range(4)))
    assert all(r == pytest.approx(first, abs=1e-5) for r in runs)
    assert sum(1 for key in rm._CACHE if key[0] == str(tiny_rm_path.resolve())) == 1


def test_reward_model_without_chat_template(tiny_rm_path, tmp_path):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    shutil.copytree(tiny_rm_path, plain)
    tok = AutoTokenizer.from_pretrained(plain)
    tok.chat_template = None
    tok.save_pretrained(plain)
    for f in plain.glob("chat_template.*"):
        f.unlink()
    assert not AutoTokenizer.from_pretrained(plain).chat_template
    got = reward_model(COMPLETIONS, prompts=PROMPTS, path=plain)
    assert got == pytest.approx(_direct_scores(plain, PROMPTS, COMPLETIONS), abs=1e-4)


def test_reward_model_errors(tiny_rm_path, tmp_path):
    with pytest.raises(ValueError, match=r"path is required"):
        reward_model(["x"], prompts=["p"])
    with pytest.raises(ValueError, match=r"path must be a local model folder.*does not exist"):
        reward_model(["x"], prompts=["p"], path=str(tmp_path / "no_such_model"))
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is not a folder"):
        reward_model(["x"], prompts=["p"], path=str(tmp_path / "file.bin"))
    for kwargs, message in [
        ({"batch_size": 0}, r"batch_size must be an integer >= 1"),
        ({"max_length": 0}, r"max_length must be an integer >= 1"),
        ({"scale": math.nan}, r"scale must be a finite number"),
        ({"device": "not-a-device"}, r"device must be a torch device"),
    ]:
        with pytest.raises(ValueError, match=message):
            reward_model(["x"], prompts=["p"], path=tiny_rm_path, **kwargs)
    with pytest.raises(ValueError, match=r"one prompt per completion"):
        reward_model(["x", "y"], prompts=["p"], path=tiny_rm_path)


def test_a_reward_model_folder_is_a_reward_by_its_path(tiny_rm_path):
    """As TRL takes a model path in reward_funcs: rewards: [{name: ./folder}] scores with it, with
    the spec's kwargs. Compared with a direct call of the same batch size, the scores are equal:
    same batches, same shapes, same kernels in one process. Against another batch size they are
    only close: other batches pad to other lengths, so the matmuls have other shapes, and the
    kernel chosen for a shape (AVX2 vs AVX-512, oneDNN's blocking) sums in another order; fp32
    rounding then moves a score by ~1e-6 (7.7e-7 seen on an AVX-512 EPYC), far below the 1e-4
    that separates the test's inputs."""
    from plait.config.schema import RewardSpec
    from plait.rewards.runner import RewardInputs, bind_rewards, call_rewards

    (bound,) = bind_rewards([RewardSpec(name=str(tiny_rm_path), kwargs={"batch_size": 2})])
    assert bound.process is None  # a folder runs on the trainer's threads (its model is cached there)
    inputs = RewardInputs(COMPLETIONS, {"prompts": PROMPTS})
    values, _ = call_rewards([bound], inputs)
    got = values[str(tiny_rm_path)]
    assert got == reward_model(COMPLETIONS, prompts=PROMPTS, path=tiny_rm_path, batch_size=2)
    assert got == pytest.approx(reward_model(COMPLETIONS, prompts=PROMPTS, path=tiny_rm_path), abs=1e-4)
