"""Seeds and comparisons on real runs: `plait train --seeds` runs one config per seed into its
own folder and compares them; `plait compare` reads groups of runs and tests their final
metric (Welch's t-test, the same numbers scipy gives for the per-run values)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from commands import plait_here
from test_train import tiny_overrides

from plait.compare import parse_seeds


pytestmark = pytest.mark.slow


def seed_group(model, data, out, seeds, *extra) -> subprocess.CompletedProcess:
    sets = sum((["--set", s] for s in tiny_overrides(model, data, out, "train.max_steps=2", *extra)), [])
    return plait_here("train", "--seeds", seeds, *sets)


@pytest.fixture(scope="module")
def groups(tiny_model_path, prompts_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    low = seed_group(tiny_model_path, prompts_jsonl, root / "lr-low", "0-2", "train.learning_rate=1e-5")
    high = seed_group(tiny_model_path, prompts_jsonl, root / "lr-high", "0,1", "train.learning_rate=1e-2")
    return root, low, high


def test_seeds_run_one_after_another_and_are_compared(groups):
    root, low, _ = groups
    assert low.returncode == 0, low.stderr[-3000:]
    runs = sorted(p.name for p in (root / "lr-low").glob("seed-*"))
    assert runs == ["seed-0", "seed-1", "seed-2"]
    seeds = {yaml.safe_load((root / "lr-low" / r / "config.yaml").read_text())["seed"] for r in runs}
    assert seeds == {0, 1, 2}
    summary = json.loads((root / "lr-low" / "compare" / "compare.json").read_text())
    (group,) = summary["groups"].values()
    rewards = group["rounds"]["reward/total/mean"]
    assert sorted(int(r) for r in rewards) == [1, 2] and all(b["n"] == 3 for b in rewards.values())
    assert rewards["1"]["std"] > 0  # other seeds sample other completions
    page = (root / "lr-low" / "compare" / "index.html").read_text()
    assert "<img" in page and "reward/total/mean" in page
    assert list((root / "lr-low" / "compare" / "tensorboard").rglob("events.out.tfevents.*"))
    assert "mean +- sd over runs" in low.stdout and "compare:" in low.stdout


def test_compare_tests_two_groups_final_metric_as_scipy_does(groups):
    from scipy.stats import ttest_ind

    root, low, high = groups
    assert high.returncode == 0, high.stderr[-3000:]
    shown = plait_here("compare", str(root / "lr-low"), str(root / "lr-high"), "--out", str(root / "ab"))
    assert shown.returncode == 0, shown.stderr
    summary = json.loads((root / "ab" / "compare.json").read_text())
    finals = {label: g["final"]["values"] for label, g in summary["groups"].items()}
    assert [len(v) for v in finals.values()] == [3, 2]  # groups of unequal size: Welch's test takes them
    (test,) = summary["tests"]
    expected = ttest_ind(finals["lr-low"], finals["lr-high"], equal_var=False)
    assert test["welch"]["p"] == pytest.approx(expected.pvalue) and test["welch"]["t"] == pytest.approx(
        expected.statistic
    )
    assert "Welch's t-test" in shown.stdout and "assumes normal, independent per-run values" in shown.stdout


def test_compare_of_a_folder_without_runs_is_a_clear_error(tmp_path):
    shown = plait_here("compare", str(tmp_path))  # no runs needed: not the seed groups above
    assert shown.returncode == 2 and "no metrics.jsonl" in shown.stderr


def test_seed_lists():
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("0-2,7,1") == [0, 1, 2, 7]
    with pytest.raises(ValueError, match="give seeds as"):
        parse_seeds("a-b")


def test_report_of_a_seed_group_is_its_comparison(groups, tmp_path):
    root, _, _ = groups
    shown = plait_here("report", str(root / "lr-low"), "--out", str(tmp_path / "page"))
    assert shown.returncode == 0, shown.stderr
    page = (tmp_path / "page" / "index.html").read_text()
    assert "<img" in page and "mean +- sd over runs" in page
