"""plait compare on run folders written as plait writes them: the held-out curve of runs that
were evaluated during training, and whether each held its best."""

import json

from plait.compare import compare, describe


def write_run(path, evals: list[tuple[int, float]]) -> None:
    path.mkdir(parents=True)
    rows = [{"round": r, "step": r, "reward/total/mean": 0.1 * r, "accuracy": 0.1 * r} for r in range(1, 11)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tags = ["before", *(f"round {r}" for r, _ in evals[1:-1]), "after"]
    records = [{"tag": t, "round": r, "step": r, "boxed_accuracy": v, "n": 100} for t, (r, v) in zip(tags, evals)]
    (path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in records))


def test_compare_shows_the_held_out_curve_and_each_run_s_last_over_best(tmp_path):
    write_run(tmp_path / "runs" / "seed-0", [(0, 0.1), (5, 0.5), (10, 0.25)])  # fell to half its best
    write_run(tmp_path / "runs" / "seed-1", [(0, 0.1), (5, 0.3), (10, 0.4)])  # still rising
    summary, page = compare([tmp_path / "runs"], tmp_path / "out")
    group = summary["groups"]["runs"]
    curve = group["rounds"]["eval/boxed_accuracy"]
    assert {r: b["mean"] for r, b in curve.items()} == {0: 0.1, 5: 0.4, 10: 0.325}
    assert [h["final_over_best"] for h in group["held"]] == [0.5, 1.0]
    assert [(h["best"], h["best_round"]) for h in group["held"]] == [(0.5, 5), (0.4, 10)]
    text = describe(summary)
    assert "boxed_accuracy at each evaluation, mean over runs (round): 0.1 (0), 0.4 (5), 0.325 (10)" in text
    assert "each run's last evaluation over its best: 0.50, 1.00" in text
    assert "<h2>eval/boxed_accuracy</h2><img" in page.read_text()


def test_runs_evaluated_only_before_and_after_show_no_held_out_curve(tmp_path):
    write_run(tmp_path / "runs" / "seed-0", [(0, 0.1), (10, 0.3)])
    summary, _ = compare([tmp_path / "runs"], tmp_path / "out")
    assert "eval/boxed_accuracy" not in summary["groups"]["runs"]["rounds"]
    assert "at each evaluation" not in describe(summary)
