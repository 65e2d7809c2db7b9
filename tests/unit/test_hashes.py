"""Per-round hashes (plait.train.hashes), the stage plait diff reads from them, and the
environment train.deterministic pins."""

from __future__ import annotations

import math

import torch

from plait.diff import HASH_STAGES, first_hash_parting
from plait.train.determinism import missing_pins, pinned_environment, pinned_lines
from plait.train.hashes import STAGES, completions_record, digest, gradient_hash, group_hash, scoring_hash, weights_hash
from plait.types import Completion, Group, Prompt


def test_a_one_ulp_change_changes_the_digest():
    t = torch.randn(1000)
    before = digest([t])
    t[123] = torch.nextafter(t[123], torch.tensor(math.inf))
    assert digest([t]) != before
    assert digest([t.clone()]) == digest([t])  # the bits, not the object


def test_shape_and_dtype_are_part_of_the_digest():
    t = torch.arange(6, dtype=torch.int32)
    assert digest([t]) != digest([t.reshape(2, 3)])
    assert digest([t]) != digest([t.view(torch.float32)])  # same bytes, another dtype
    b = torch.randn(4, dtype=torch.bfloat16)
    assert digest([b]) != digest([b.view(torch.int16)])  # bf16 hashed by its bits, named as bf16


def test_weights_and_gradient_hashes_see_one_parameter_change():
    model = torch.nn.Linear(4, 3)
    assert gradient_hash(model) is None  # no gradient yet: not hashed (never a hash of nothing)
    before = weights_hash(model)
    with torch.no_grad():
        model.bias[0] = torch.nextafter(model.bias[0], torch.tensor(math.inf))
    assert weights_hash(model) != before
    model(torch.ones(2, 4)).sum().backward()
    assert isinstance(gradient_hash(model), str)


def test_scoring_hash_sees_one_ulp_in_one_score():
    prompt = Prompt(index=0, text="q", token_ids=[1])
    done = [Completion(0, [2], "a", [0.0], False, "eos")]
    a = [Group(prompt, done, rewards={"r": [0.25]})]
    b = [Group(prompt, done, rewards={"r": [math.nextafter(0.25, 1.0)]})]
    assert scoring_hash(a) != scoring_hash(b)


def groups_of(*completions: list[list[int]]) -> list[Group]:
    """One group per argument, prompt i with the given completions' token ids."""
    return [
        Group(Prompt(i, f"q{i}", [7, i]), [Completion(i, ids, "", [0.0] * len(ids), False, "eos") for ids in done])
        for i, done in enumerate(completions)
    ]


def test_the_completions_record_does_not_depend_on_which_process_holds_a_group():
    """1 process or 2 (any split), the same completions give the same record; one token, or two
    completions of a group swapped, give another."""
    groups = groups_of([[1, 2], [3]], [[4], [5, 6]], [[8], [9]])
    one = completions_record([[group_hash(g) for g in groups]])
    for split in ([groups[:1], groups[1:]], [groups[2:], groups[:2]], [[], groups]):
        assert completions_record([[group_hash(g) for g in part] for part in split]) == one
    token = groups_of([[1, 2], [3]], [[4], [5, 7]], [[8], [9]])
    swapped = groups_of([[3], [1, 2]], [[4], [5, 6]], [[8], [9]])
    for other in (token, swapped):
        assert completions_record([[group_hash(g) for g in other]]) != one


def test_diff_reads_the_stages_the_hashes_write():
    assert HASH_STAGES == STAGES


def record(round_, **hashes):
    return {"round": round_, **{s: hashes.get(s, f"{s}-{round_}") for s in STAGES}}


def test_first_hash_parting_names_the_earliest_stage_of_the_first_round():
    a = {r: record(r) for r in (1, 2, 3)}
    b = {1: record(1), 2: record(2, loss="x", optimizer="y"), 3: record(3, generation="z")}
    p = first_hash_parting(a, b)
    assert (p.round, p.stage, p.rounds_compared) == (2, "loss", 3)
    assert first_hash_parting(a, a).round is None


def test_the_completions_record_is_compared_apart_from_the_stages():
    """1 vs 2 processes: the generation stage differs from round 1 (it hashes each process's
    padded rows), and the completions record still says where the sampled tokens part."""
    a = {r: {**record(r), "completions": f"c{r}"} for r in (1, 2, 3)}
    b = {r: {**record(r, generation=f"two-{r}"), "completions": "x" if r == 3 else f"c{r}"} for r in (1, 2, 3)}
    p = first_hash_parting(a, b)
    assert (p.round, p.stage) == (1, "generation")
    assert (p.completions_compared, p.completions_part) == (3, 3)
    older = {r: record(r) for r in (1, 2, 3)}  # a run of a plait that did not record it
    assert first_hash_parting(a, older).completions_compared == 0


def test_stages_one_run_did_not_hash_are_skipped():
    """A run without train.deterministic has no gradient or weight hashes: compared on the rest."""
    a = {1: record(1)}
    b = {1: record(1, loss=None, optimizer=None)}
    p = first_hash_parting(a, b)
    assert p.round is None and p.stages == ["generation", "scoring", "advantages"]


def test_the_kernel_caps_are_pinned_on_x86_only():
    assert pinned_environment("x86_64")["ATEN_CPU_CAPABILITY"] == "avx2"
    assert "ATEN_CPU_CAPABILITY" not in pinned_environment("aarch64")
    assert pinned_environment("aarch64")["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_what_is_missing_is_said(monkeypatch):
    for k in pinned_environment():
        monkeypatch.delenv(k, raising=False)
    assert missing_pins() == pinned_environment()
    lines = pinned_lines("AVX512", 2, "cpu")
    assert "not pinned" in lines[0] and "start through `plait train`" in lines[0]
    for k, v in pinned_environment().items():
        monkeypatch.setenv(k, v)
    assert missing_pins() == {}
    lines = pinned_lines("AVX2", 3, "cpu")
    assert not any("not pinned" in line for line in lines)
    assert "threads pinned to 3 per process (runs compare bit for bit at the same count)" in lines
