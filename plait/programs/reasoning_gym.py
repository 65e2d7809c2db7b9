"""reasoning-gym (https://github.com/open-thought/reasoning-gym): procedural task generators,
each with its own verifier, `score_answer(answer, entry)`.

A row keeps where its problem came from (dataset, config, seed, size, index), never the entry
itself: the scoring process rebuilds the entry from those, because some datasets (arc_agi,
rearc) score wrong after a JSON round-trip of their entries.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
from typing import Any


# reasoning-gym's default system prompt asks for <answer> tags; with answer_format=boxed this
# follows the question instead (small models follow an instruction in the user's turn better)
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
# the eval split's seed: far from any train seed, so the two splits are drawn apart
EVAL_SEED_OFFSET = 1_000_003
# the worked examples' seed, apart from both splits'
EXAMPLE_SEED_OFFSET = 2_000_003


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def dataset(source: dict):
    """The reasoning-gym dataset a row came from (cached per process)."""
    return _dataset(source["dataset"], json.dumps(source["config"], sort_keys=True), source["seed"], source["size"])


def system_prompt(spec) -> str | None:
    if spec.answer_format == "boxed":
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def _question(entry: dict, answer_format: str) -> str:
    return entry["question"].rstrip() + (f"\n\n{BOXED_INSTRUCTION}" if answer_format == "boxed" else "")


def _answered(answer, answer_format: str) -> str:
    return f"\\boxed{{{answer}}}" if answer_format == "boxed" else f"<answer>{answer}</answer>"


def _questions(source: dict) -> frozenset[str]:
    return _questions_of(json.dumps(source, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _questions_of(source_json: str) -> frozenset[str]:
    """The split's questions, made once per process: `plait check` and the run's rows both need
    them, and some datasets take seconds per thousand problems."""
    source = json.loads(source_json)
    ds = dataset(source)
    return frozenset(ds[i]["question"] for i in range(source["size"]))


def _asked(spec, seed: int, train_size: int) -> set[str]:
    """The questions of the environment's training and held-out problems (as the dataset words them)."""
    train = {"dataset": spec.dataset, "config": spec.config, "seed": seed, "size": train_size}
    return {*_questions(train), *_questions({**train, "seed": seed + EVAL_SEED_OFFSET, "size": spec.eval_size})}


def _own_examples(spec) -> list[dict]:
    """The config's own worked examples as turns: each question asked as the prompts ask it."""
    turns = []
    for e in spec.examples:
        turns += [
            {"role": "user", "content": _question({"question": e.prompt}, spec.answer_format)},
            {"role": "assistant", "content": e.completion},
        ]
    return turns


def worked_examples(spec, seed: int, train_size: int) -> list[dict]:
    """The worked examples as turns: the config's own (a list), or `spec.examples` problems of
    the dataset drawn with a third seed, none a training or held-out problem, the question
    asked as the prompts ask it and the reference answer given in the answer format (fewer
    when the problem space holds no more new ones)."""
    if not spec.examples:
        return []
    if isinstance(spec.examples, list):
        return _own_examples(spec)
    taken = _asked(spec, seed, train_size)
    train = {"dataset": spec.dataset, "config": spec.config, "seed": seed, "size": train_size}
    ds = dataset({**train, "seed": seed + EXAMPLE_SEED_OFFSET, "size": 8 * spec.examples + 32})
    turns = []
    for i in range(len(ds)):
        if len(turns) == 2 * spec.examples:
            break
        entry = ds[i]
        if entry["question"] in taken or entry["answer"] is None:
            continue
        taken.add(entry["question"])
        turns += [
            {"role": "user", "content": _question(entry, spec.answer_format)},
            {"role": "assistant", "content": _answered(entry["answer"], spec.answer_format)},
        ]
    return turns


def _example_problems(spec, label: str, seed: int, train_size: int) -> list[str]:
    """The config's own worked examples: each states its answer in the answer format (the
    model copies their form), and none is a training or held-out problem (its answer would be
    in the prompt)."""
    out = []
    asked = {q.strip() for q in _asked(spec, seed, train_size)}
    where = "\\boxed{...}" if spec.answer_format == "boxed" else "<answer>...</answer>"
    for n, e in enumerate(spec.examples):
        if extract_answer(e.completion, spec.answer_format) is None:
            out.append(
                f"environments: '{label}': worked example {n}'s completion gives no answer in {where} "
                f"(answer_format={spec.answer_format}); the model copies the examples' form, so end it with one"
            )
        if e.prompt.strip() in asked:
            out.append(
                f"environments: '{label}': worked example {n} is one of its own training or held-out problems, so "
                "its answer would be in those prompts; pick another problem"
            )
    return out


def rows(spec, label: str, split: str, seed: int, train_size: int) -> list[dict]:
    """The problems of the environment `spec` for `split`: `train_size` of them for "train";
    for "eval", `spec.eval_size` drawn with another seed, less those also in the train split."""
    train = {"dataset": spec.dataset, "config": spec.config, "seed": seed, "size": train_size}
    source = train if split == "train" else {**train, "seed": seed + EVAL_SEED_OFFSET, "size": spec.eval_size}
    ds = dataset(source)
    seen = _questions(train) if split == "eval" else set()
    out = []
    for i in range(source["size"]):
        entry = ds[i]
        if entry["question"] in seen:
            continue
        where = {"type": "reasoning_gym", **source, "index": i, "answer_format": spec.answer_format}
        out.append(
            {
                "prompt": _question(entry, spec.answer_format),
                "answer": None if entry["answer"] is None else str(entry["answer"]),
                "environment": label,
                "env_source": {**where, "problem": _digest(entry)},
            }
        )
    return out


class NotRebuilt(RuntimeError):
    """The scoring process rebuilt another problem than the row's (an infrastructure error)."""


def _digest(entry: dict) -> str:
    """A short fingerprint of a problem (its question and answer): the scoring process checks it
    rebuilt the problem that was asked."""
    return hashlib.sha256(f"{entry['question']}\0{entry['answer']}".encode()).hexdigest()[:16]


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str, answer_format: str) -> str | None:
    """The model's final answer: the last <answer>...</answer> (reasoning-gym's convention), or
    the last \\boxed{...}."""
    if answer_format == "boxed":
        from plait.rewards.math import last_boxed  # plait.rewards imports this package

        return last_boxed(text)
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def score_answer(source: dict, answer: str) -> float:
    """The dataset's own verdict on `answer` for the row's problem, rebuilt here. Raises when
    the environment itself fails: that is an infrastructure error, not a score. The one
    exception: a ValueError (what parsing a malformed value raises: prime_factorization's int()
    of a factor that is not a number) from a verifier that scores the problem's own reference
    answer: the answer could not be read as one, so it scores 0."""
    ds = dataset(source)
    entry = ds[source["index"]]
    if source.get("problem", _digest(entry)) != _digest(entry):
        raise NotRebuilt(
            f"reasoning-gym's '{source['dataset']}' built another problem for entry {source['index']} than the one "
            "asked (its generator does not repeat itself), so the answer cannot be scored; pick another dataset"
        )
    try:
        return float(ds.score_answer(answer=answer, entry=entry))
    except ValueError:
        if not _scores_its_own_answer(json.dumps(source, sort_keys=True)):
            raise
        return 0.0


@functools.lru_cache(maxsize=4096)
def _scores_its_own_answer(source_json: str) -> bool:
    """Whether the verifier scores the problem's reference answer, as the answer format carries
    it, without raising."""
    source = json.loads(source_json)
    ds = dataset(source)
    entry = ds[source["index"]]
    fmt = source["answer_format"]
    try:
        ds.score_answer(answer=extract_answer(_answered(entry["answer"], fmt), fmt), entry=entry)
    except Exception:
        return False
    return True


def problems(spec, label: str, seed: int, train_size: int, evaluating: bool) -> list[str]:
    """What `plait check` finds before a model loads: an unknown dataset or option, entries
    without a reference answer, a verifier that does not give its own answer full marks, no
    held-out problem left once those also in training are dropped."""
    try:
        import reasoning_gym  # noqa: F401
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return [f"environments: '{label}' needs reasoning-gym: pip install 'plait[envs]' (make setup installs it)"]
    if spec.dataset not in DATASETS:
        near = difflib.get_close_matches(spec.dataset, list(DATASETS), n=1)
        return [
            f"environments: '{label}': reasoning-gym has no dataset '{spec.dataset}'."
            + (f" Did you mean '{near[0]}'?" if near else "")
            + ' (`python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))"` lists them)'
        ]
    if spec.dataset == "composite":  # it takes DatasetSpec objects, which YAML cannot give
        return [
            f"environments: '{label}': reasoning-gym's 'composite' is configured with its own Python objects; list "
            "its datasets as entries of `environments` instead: they are a weighted mixture (`weight:` per entry)"
        ]
    try:
        first = rows(spec, label, "train", seed, 1)[0]
    except Exception as err:  # the dataset's own config validation: name the option
        return [f"environments: '{label}': reasoning-gym could not build '{spec.dataset}' with {spec.config}: {err}"]
    if first["answer"] is None:
        return [
            f"environments: '{label}': '{spec.dataset}' entries have no reference answer (answer is None), so "
            "plait can't check a completion's answer offline; pick another dataset"
        ]
    why = _reference_problems(spec, label, seed, train_size)
    if why:
        return [why]
    if isinstance(spec.examples, list):
        return _example_problems(spec, label, seed, train_size) + _held_out_problems(
            spec, label, seed, train_size, evaluating
        )
    shots = len(worked_examples(spec, seed, train_size)) // 2
    if shots < spec.examples:
        return [
            f"environments: '{label}': only {shots} of its {spec.examples} worked examples could be drawn that are "
            "neither training nor held-out problems (a small problem space); lower its examples or its size"
        ]
    return _held_out_problems(spec, label, seed, train_size, evaluating)


# problems whose reference answers `plait check` scores (and rebuilds, to see they repeat)
CHECKED_PROBLEMS = 8


def _reference_problems(spec, label: str, seed: int, train_size: int) -> str | None:
    """The first problems, each rebuilt as the scoring process rebuilds it, must be the problem
    asked, and give their own reference answer, in the answer format, full marks."""
    fmt = spec.answer_format
    for row in rows(spec, label, "train", seed, min(CHECKED_PROBLEMS, train_size)):
        answer = extract_answer(_answered(row["answer"], fmt), fmt)
        try:
            full = score_answer(row["env_source"], answer if answer is not None else "")
        except NotRebuilt as err:
            return f"environments: '{label}': {err}"
        except Exception as err:
            return f"environments: '{label}': scoring its own answer raised {type(err).__name__}: {err}"
        if full < 1.0:
            index = row["env_source"]["index"]
            hint = "try the other answer_format" + (
                " (answer_tag: a box cannot hold an answer whose braces do not pair)" if fmt == "boxed" else ""
            )
            return (
                f"environments: '{label}': '{spec.dataset}' scores its own reference answer to problem {index} "
                f"({row['answer'][:80]!r}) {full:g}, not 1, with answer_format={fmt}; {hint}"
            )
    return None


def _held_out_problems(spec, label: str, seed: int, train_size: int, evaluating: bool) -> list[str]:
    if evaluating and not rows(spec, label, "eval", seed, train_size):
        return [
            f"environments: '{label}': none of its {spec.eval_size} held-out problems is new: all are among its "
            f"{train_size} training problems (a small problem space); widen its config, lower its size, or turn "
            "evaluation off (eval.before/after=false)"
        ]
    return []


def describe(spec: Any) -> str:
    return f"reasoning-gym '{spec.dataset}'" + (f" {spec.config}" if spec.config else "")
