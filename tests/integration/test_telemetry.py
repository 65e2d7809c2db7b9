"""Telemetry of a real (tiny) run: the per-step figures, TensorBoard and W&B files, and the
HTML report, opened in a real headless Chromium."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from test_train import tiny_overrides

from plait.cli import main
from plait.config import load_config
from plait.train.loop import train


PHASES = ("generate", "score", "train", "optimizer", "idle", "checkpoint")


@pytest.fixture(scope="module")
def run_dir(tiny_model_path, prompts_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("telemetry") / "run"
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_model_path,
            prompts_jsonl,
            out,
            "train.max_steps=3",
            "log.sample_every_steps=1",
            "log.samples=2",
            "eval.before=true",
            "eval.after=true",
            "checkpoint.save_steps=2",
        ),
    )
    result = train(cfg)
    return result.run_dir


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_step_has_phases_throughput_mfu_and_memory(run_dir):
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        phases = {k[5:]: v for k, v in m.items() if k.startswith("time/") and k != "time/step"}
        for p in ("generate", "score", "train", "optimizer", "idle"):
            assert phases[p] >= 0, p
        # one process: the phases (idle included) account for the whole step, no second counted twice
        assert sum(phases.values()) == pytest.approx(m["time/step"], rel=1e-6)
        assert m["tokens/s_train"] > 0 and m["tokens/s_generate"] > 0
        assert 0 < m["mfu/train"] < 2 and 0 < m["mfu/step"] < 2  # against a measured CPU peak: a sane fraction
        assert m["flops/step"] > 0
        # the step's peak (VmHWM) includes the RSS read just before it (16 MiB: other threads may free
        # memory between the two reads); tests/unit/test_flops_and_timing.py checks it is per step
        assert m["memory/rss_gb"] > 0.05 and m["memory/peak_rss_gb"] >= m["memory/rss_gb"] - 16 / 1024
        assert m["reward/plait_test_rewards:vowel_share/seconds"] > 0  # each round called it, and timed the call
        assert m["comm/seconds"] == 0.0  # one process: no collective ran
    assert "time/checkpoint" in rows[2]  # save_steps=2: step 2's save, counted in the next round's time


def test_tensorboard_events_hold_the_scalars_and_samples(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    # every number metrics.jsonl holds (its round aside; a non-finite one is null there and left
    # out of TensorBoard), under the same name at the same round; TensorBoard stores float32
    jsonl: dict[str, list[tuple[int, float]]] = {}
    for m in metrics(run_dir):
        for k, v in m.items():
            if k not in ("round", "step") and isinstance(v, (int, float)) and math.isfinite(v):
                jsonl.setdefault(k, []).append((m["round"], float(v)))
    assert {"reward/total/mean", "mfu/train", "loss", "grad_norm", "time/train"} <= set(jsonl)
    assert sorted(tags["scalars"]) == sorted(jsonl)  # no tag missing, none extra
    for tag, expected in jsonl.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r for r, _ in expected], tag
        assert [e.value for e in events] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert [e.step for e in acc.Scalars("time/train")] == [1, 2, 3]
    assert any(t.startswith("samples") for t in tags["tensors"])  # add_text is stored as a tensor summary


def test_samples_log_prompt_completion_and_each_reward(run_dir):
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["round"] for s in samples] == [1, 1, 2, 2, 3, 3]  # log.samples=2 groups per round
    assert all(s["step"] == s["round"] for s in samples)  # `step`, the old name, is kept as an alias
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["step"]) for r in rows] == [(1, 1), (2, 2), (3, 3)]
    for s in samples:
        assert s["prompt"] and isinstance(s["completion"], str)
        assert set(s["rewards"]) == {"plait_test_rewards:vowel_share"}


def report_page(run_dir, tmp_path):
    """`plait report RUN --out DIR`, the command in this process."""
    out = tmp_path / "report"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    return out / "index.html"


def test_report_is_self_contained(run_dir, tmp_path):
    page = report_page(run_dir, tmp_path)
    html = page.read_text()
    import base64
    import re

    for name in ("rewards", "length", "policy", "time", "throughput", "memory"):
        png = page.parent / "figures" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        # inlined: the page carries the PNG itself, byte for byte, as a data URI
        inlined = re.search(rf"id='fig-{name}'[^>]*src='data:image/png;base64,([^']+)'", html)
        assert inlined and base64.b64decode(inlined.group(1)) == png.read_bytes(), name
    srcs = re.findall(r"""src=['"]([^'"]*)""", html)
    assert srcs and all(src.startswith("data:") for src in srcs)  # nothing fetched: opens offline
    assert "<link" not in html and "<script" not in html.lower() and "javascript:" not in html.lower()
    assert not re.search(r"<[^>]*\son[a-z]+\s*=", html)  # no event handler in any tag: no script at all
    assert html.count("<tr><td class='num'>") >= 6  # the sample table's rows


def test_report_of_a_directory_without_a_run_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (`make test` installs them as root)",
)
def test_report_opens_in_headless_chromium(run_dir, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    page = report_page(run_dir, tmp_path)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        driver.get(page.as_uri())
        figures = driver.execute_script(
            "return Array.from(document.querySelectorAll('img.figure'))"
            ".map(i => [i.id, i.complete, i.naturalWidth, i.naturalHeight])"
        )
        assert {f[0] for f in figures} == {
            f"fig-{n}" for n in ("rewards", "length", "policy", "time", "throughput", "memory")
        }
        for fid, complete, width, height in figures:
            assert complete and width > 300 and height > 100, (fid, width, height)  # decoded, not a broken image
        rows = driver.execute_script("return document.querySelectorAll('#samples tr').length")
        assert rows == 1 + 6
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        driver.quit()


@pytest.mark.skipif(__import__("importlib").util.find_spec("wandb") is None, reason="needs the wandb extra")
def test_wandb_offline_run_records_the_metrics(tiny_model_path, prompts_jsonl, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_SILENT="true", WANDB_API_KEY="", HOME=str(tmp_path))  # no account, no network
    args = tiny_overrides(
        tiny_model_path, prompts_jsonl, out, "train.max_steps=2", "log.wandb={mode: offline, project: plait-test}"
    )
    argv = ["train", *[x for a in args for x in ("--set", a)]]
    code = f"from plait.cli import main; import sys; sys.exit(main({argv!r}))"
    helpers = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers")
    env["PYTHONPATH"] = os.pathsep.join([helpers, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"reward/total/mean" in data and b"mfu/train" in data
    run_id = (out / "wandb_id").read_text().strip()
    assert run_id in runs[0].name  # a resumed run continues this W&B run


def test_the_telemetry_bench_runs_and_times_every_part():
    """bench/telemetry.py still wraps the functions it times (they move as the loop changes):
    every per-step part and both start-up costs get a row. Its figures are the bench's business."""
    from pathlib import Path

    bench = Path(__file__).parents[2] / "bench" / "telemetry.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--model", "tiny", "--steps", "3"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for part in ("rollout statistics", "reward timeouts/seconds", "FLOPs count", "per-step figures", "sinks:"):
        assert part in proc.stdout, part
    assert "all per-step telemetry" in proc.stdout and proc.stdout.count("s once") == 2
