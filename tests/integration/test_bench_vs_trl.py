"""bench/vs_trl.py runs both trainers on the same work and reports comparable figures (on a
tiny model here; the timings themselves are the benchmark's business, not a test's)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(__import__("importlib").util.find_spec("trl") is None, reason="needs the bench extra (trl)"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_vs_trl_runs_both_on_the_same_work(tiny_model_path, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "vs_trl.py"),
            "--model",
            str(tiny_model_path),
            "--size",
            "small",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for who in ("plait", "trl"):
        r = res[who]
        assert len(r["step_s"]) == 2 and all(s > 0 for s in r["step_s"]), who  # the warm-up step is left out
        assert [len(x) for x in r["reward_per_step"]] == [3], who  # one mean reward per step, warm-up included
        assert r["tokens_per_s"] > 0 and r["peak_rss_gb"] > 0.1
    assert res["ratio"] == pytest.approx(res["plait"]["step_s_median"] / res["trl"]["step_s_median"])
    assert 0 < res["reward_p"] <= 1 and res["learning"] in ("indistinguishable", "plait better", "TRL better")
    assert "plait / TRL step time" in proc.stdout
    # both sides trained on the same prompts at each step, read from what each side's rewards were
    # given: TRL was handed plait's draw order, not its own shuffle
    mine, theirs = res["plait"]["prompts_per_step"][0], res["trl"]["prompts_per_step"][0]
    assert len(mine) == 3 and all(len(step) == 2 for step in mine), mine
    assert [sorted(x) for x in mine] == [sorted(x) for x in theirs]
    assert len({p for step in mine for p in step}) == 6  # six different problems, not one repeated
    assert res["per_seed"][0]["same_prompts"] is True and "same prompts each step: yes" in proc.stdout
    phases = res["plait"]["phase_s_median"]  # where plait's step goes, from its own telemetry
    assert {"generate", "train", "optimizer"} <= set(phases) and phases["generate"] > 0 and phases["train"] > 0
    assert sum(phases.values()) <= max(res["plait"]["step_s"])  # two timed steps: each median is a mean
