"""Chaos: kill a training run again and again; it must end exactly where an unbroken run ends.

    .venv/bin/python bench/chaos.py [--kills 6] [--nproc 2] [--steps 10] [--save-steps 2] [--seed 0] [--async K]
                                    [--json out.json]

Runs a short GRPO training of a tiny random model once without interruption (the reference),
then again with the same config while SIGKILLing a random training process `--kills` times at
these moments:

- startup: during start-up or resume;
- step: in the middle of a step;
- unsaved: as soon as a round is logged that no committed checkpoint holds yet (before the first
  checkpoint, too): its records must be dropped and written again;
- save: while a checkpoint is being written (the harness watches for the `.tmp` folder).

After each kill it starts the run again with `resume=auto`, as a requeueing scheduler would. At
the end it compares, bit for bit:

- the final weights (final/model.safetensors),
- every committed checkpoint (weights and optimizer state) with the reference's of that step,
- the per-step metrics (loss, rewards, grad norm, ...; timings excluded), each step logged once.

With `--async K` the run generates asynchronously (rollout.max_staleness=K, the HF engine's
generation process) and a fourth moment is added: killing the generation process in the middle
of the run, after which the trainer stops with an error and is relaunched the same way. The
first kills go through every moment once (in a seeded order); the rest are drawn at random,
each once its launch has committed a checkpoint, so those runs resume from one. The report lists
the moments in the order they were hit.

It prints the kills by moment, the resumes, the checkpoints a resume loaded that were not
identical to the reference's ("corrupt loads", must be 0), the largest weight difference
(must be 0.0 on CPU) and exits 1 if anything differs, or if a launch did not resume from the
newest checkpoint committed when it started (each launch's own log lines say what it loaded).
`--nproc 2` runs under torchrun (ddp) and kills one of the two workers; torchrun then stops the
other.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from plait.telemetry.meter import is_measurement


REWARD = """def vowel_share(completions, **_):
    return [sum(ch in "aeiouAEIOU" for ch in t) / max(1, len(t)) for t in completions]
"""
MOMENTS = ("startup", "step", "unsaved", "save")
RESUMED = re.compile(r"resumed from \S+ \((?:round|step) (\d+)\)")  # what a launch says it loaded
ASYNC_MOMENTS = (*MOMENTS, "generation")


@dataclass
class Report:
    kills: dict = field(default_factory=lambda: {m: 0 for m in ASYNC_MOMENTS})
    moments: list = field(default_factory=list)  # in the order they were hit
    launches: int = 0
    resumes: int = 0
    corrupt_loads: int = 0
    incomplete_checkpoints_seen: int = 0  # step_X.tmp left by a kill: never loaded
    checkpoints_compared: int = 0
    checkpoints_differing: int = 0
    metrics_differing: list = field(default_factory=list)
    hashes_identical: bool = False
    max_weight_diff: float = 0.0
    optimizer_identical: bool = False
    steps_logged: list = field(default_factory=list)
    # one entry per launch: the newest committed checkpoint when it started (0: none), the round it
    # says it resumed from (None: it started afresh, or was killed before it said), the moment it
    # was killed at (None: not killed) and the newest committed checkpoint right after that kill
    launch_log: list = field(default_factory=list)
    resumed_from_the_newest: bool = False  # every launch not killed at start-up resumed from launch_log's newest
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.corrupt_loads == 0
            and self.checkpoints_differing == 0
            and not self.metrics_differing
            and self.max_weight_diff == 0.0
            and self.optimizer_identical
            and self.hashes_identical
            and self.resumed_from_the_newest
        )


def setup(work: Path) -> tuple[Path, Path]:
    from plait.data.tasks import arithmetic
    from plait.models import tiny_model

    model = tiny_model(work / "model")
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in arithmetic("train", 64)]
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "chaos_rewards.py").write_text(REWARD)
    return model, data


def overrides(model: Path, data: Path, out: Path, steps: int, seed: int, save_steps: int = 2) -> list[str]:
    return [
        f"model.name_or_path={model}",
        "data.task=null",
        f"data.path={data}",
        "data.prompt_field=question",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=12",
        "train.micro_batch_size=4",
        f"train.max_steps={steps}",
        "train.learning_rate=1e-3",
        "train.warmup_steps=2",
        "train.precision=fp32",
        "train.threads=1",
        "rewards=[{name: 'chaos_rewards:vowel_share'}]",
        "eval.before=false",
        "eval.after=false",
        f"checkpoint.save_steps={save_steps}",
        "checkpoint.keep_last=1000",
        "log.console=plain",
        f"output_dir={out}",
        f"seed={seed}",
        "resume=auto",
    ]


def command(nproc: int, sets: list[str]) -> list[str]:
    flags = sum((["--set", s] for s in sets), [])
    if nproc == 1:
        return [sys.executable, "-m", "plait", "train", *flags]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(random.Random().randint(20000, 40000)),
        "-m",
        "plait",
        "train",
        *flags,
    ]


def trainers(proc: subprocess.Popen, nproc: int) -> list[psutil.Process]:
    """The training processes: the launched one, or torchrun's workers (its own children; not
    the generation process or the rewards' processes they start)."""
    try:
        if nproc == 1:
            return [psutil.Process(proc.pid)]
        return [c for c in psutil.Process(proc.pid).children() if " plait " in f" {' '.join(c.cmdline())} "]
    except psutil.Error:
        return []


def generators(proc: subprocess.Popen) -> list[psutil.Process]:
    """The HF generation process(es) an async run started."""
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
        return [c for c in below if "plait.rollout.server" in " ".join(c.cmdline())]
    except psutil.Error:
        return []


def committed(out: Path) -> list[int]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    # a step_X.tmp holds its marker for a moment before the rename that commits it
    done = [p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / "COMMITTED").is_file()]
    return sorted(int(p.name.split("_")[1]) for p in done)


def logged_this_launch(out: Path, launched: float, resumed_at: int) -> int:
    """The newest round this launch logged (0: none yet). A launch first cuts metrics.jsonl
    back to the round it resumes from (rewriting the file), then appends a line per round."""
    path = out / "metrics.jsonl"
    try:
        if path.stat().st_mtime < launched:
            return 0  # not cut back yet: the lines are the killed launch's
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]
    except (FileNotFoundError, ValueError):
        return 0
    newest = max(steps, default=0)
    return newest if newest > resumed_at else 0


def wait_for_round(proc, out: Path, launched: float, resumed_at: int, unsaved: bool = False) -> bool:
    """Block until this launch logged a round (one no committed checkpoint holds, if `unsaved`);
    False if the run ended first."""
    while proc.poll() is None:
        step = logged_this_launch(out, launched, resumed_at)
        if step and (not unsaved or step > max(committed(out), default=0)):
            return True
        time.sleep(0.005)
    return False


def wait_for_commit(proc, out: Path, resumed_at: int) -> bool:
    """Block until this launch committed a checkpoint; False if the run ended first."""
    while proc.poll() is None:
        if max(committed(out), default=0) > resumed_at:
            return True
        time.sleep(0.01)
    return False


def wait_for_moment(proc, out: Path, moment: str, rng: random.Random, launched: float, resumed_at: int) -> bool:
    """Block until the moment to kill (True), or until the run ends first (False)."""
    start = time.monotonic()
    if moment == "startup":
        delay = rng.uniform(0.5, 4.0)
        while time.monotonic() - start < delay:
            if proc.poll() is not None:
                return False
            time.sleep(0.01)
        return True
    if moment == "unsaved":
        return wait_for_round(proc, out, launched, resumed_at, unsaved=True)
    if moment in ("step", "generation"):
        if not wait_for_round(proc, out, launched, resumed_at):  # training is under way in this launch
            return False
        delay = rng.uniform(0.0, 0.4)
        end = time.monotonic() + delay
        while time.monotonic() < end:
            if proc.poll() is not None:
                return False
            time.sleep(0.005)
        return True
    root = out / "checkpoints"
    while True:  # save: a step_X.tmp this launch created (an earlier kill may have left one) is being written
        if proc.poll() is not None:
            return False
        try:
            if root.is_dir() and any(p.stat().st_mtime >= launched for p in root.glob("step_*.tmp")):
                return True
        except FileNotFoundError:  # renamed while we looked: the next one will do
            pass
        time.sleep(0.001)


def launch(cmd, work: Path, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def run_to_end(cmd, work: Path, log_path: Path) -> None:
    with log_path.open("a") as log:
        proc = launch(cmd, work, log)
        if proc.wait() != 0:
            raise SystemExit(f"chaos: a run failed without being killed; see {log_path}")


def chaos_run(
    cmd,
    work: Path,
    out: Path,
    kills: int,
    steps: int,
    rng: random.Random,
    nproc: int,
    report: Report,
    say,
    moments: tuple[str, ...] = MOMENTS,
) -> None:
    log_path = work / "chaos.log"
    done_kills, left = 0, set()
    planned = rng.sample(moments, len(moments))  # every moment once first
    while True:
        with log_path.open("a") as log:
            launched, resumed_at = time.time(), max(committed(out), default=0)
            entry = {"newest_commit": resumed_at, "resumed_from": None, "killed_at": None, "commit_at_kill": None}
            offset = log_path.stat().st_size  # this launch's lines come after
            proc = launch(cmd, work, log)
            report.launches += 1
            if done_kills < kills:
                if done_kills < len(planned):  # every moment once, whatever it takes
                    moment = planned[done_kills]
                else:  # then at random, each after this launch committed a checkpoint (so resumes happen)
                    moment = "step" if steps - resumed_at >= 3 else "startup"
                    moment = rng.choice(moments) if moment == "step" else moment
                ready = done_kills < len(planned) or moment == "startup" or wait_for_commit(proc, out, resumed_at)
                if ready and wait_for_moment(proc, out, moment, rng, launched, resumed_at):
                    victims = generators(proc) if moment == "generation" else trainers(proc, nproc)
                    while not victims and proc.poll() is None:  # torchrun is still starting its workers
                        time.sleep(0.05)
                        victims = trainers(proc, nproc)
                    if victims:
                        victim = rng.choice(victims)
                        try:
                            victim.send_signal(signal.SIGKILL)
                            done_kills += 1
                            report.kills[moment] += 1
                            report.moments.append(moment)
                            held = committed(out)
                            entry.update(killed_at=moment, commit_at_kill=max(held, default=0))
                            say(
                                f"kill {done_kills}/{kills}: SIGKILL pid {victim.pid} at {moment} "
                                f"(committed checkpoints: {held[-3:]})"
                            )
                        except psutil.Error:
                            pass
            code = proc.wait()
            if nproc > 1:  # torchrun stops the other worker; make sure nothing is left
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        with log_path.open("rb") as log:
            log.seek(offset)
            said = sorted({int(m.group(1)) for m in RESUMED.finditer(log.read().decode(errors="replace"))})
        entry["resumed_from"] = said[0] if len(said) == 1 else (said or None)  # several: a list, never as expected
        report.launch_log.append(entry)
        left.update(p.name for p in (out / "checkpoints").glob("*.tmp")) if (out / "checkpoints").is_dir() else None
        report.incomplete_checkpoints_seen = len(left)
        if code == 0:
            return
        if report.launches > 4 * kills + 4:
            raise SystemExit(f"chaos: the run keeps failing; see {log_path}")


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a) if a.keys() == b.keys() else float("inf")


def compare(ref: Path, out: Path, work: Path, report: Report) -> None:
    fa, fb = load_file(str(ref / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    report.max_weight_diff = max_diff(fa, fb)
    for step in committed(out):
        a, b = ref / "checkpoints" / f"step_{step:08d}", out / "checkpoints" / f"step_{step:08d}"
        report.checkpoints_compared += 1
        same_weights = same_tree(load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors")))
        same = same_weights and same_tree(
            torch.load(a / "optimizer.pt", weights_only=False), torch.load(b / "optimizer.pt", weights_only=False)
        )
        report.checkpoints_differing += not same
    last = max(committed(out))
    report.optimizer_identical = same_tree(
        torch.load(ref / "checkpoints" / f"step_{last:08d}" / "optimizer.pt", weights_only=False),
        torch.load(out / "checkpoints" / f"step_{last:08d}" / "optimizer.pt", weights_only=False),
    )
    # every resume names what it loaded: it must be a committed checkpoint identical to the reference's
    for m in re.finditer(r"resumed from (\S+) \((?:round|step) (\d+)\)", (work / "chaos.log").read_text()):
        report.resumes += 1
        loaded, step = Path(m.group(1)), int(m.group(2))
        twin = ref / "checkpoints" / f"step_{step:08d}"
        if not (loaded / "COMMITTED").is_file() or not same_tree(
            load_file(str(loaded / "model.safetensors")), load_file(str(twin / "model.safetensors"))
        ):
            report.corrupt_loads += 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    refs = {r["step"]: r for r in (json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines())}
    report.steps_logged = [r["step"] for r in rows]
    for r in rows:
        keys = [k for k in refs[r["step"]] if not is_measurement(k)]
        bad = [k for k in keys if r.get(k) != refs[r["step"]][k]]
        if bad:
            report.metrics_differing.append({"step": r["step"], "keys": bad[:5]})
    if report.steps_logged != sorted(refs):
        report.metrics_differing.append({"steps": report.steps_logged})
    # the rounds' hashes (tokens, rewards, advantages): each round sampled and scored the same bits
    hashes = [(out / "hashes.jsonl").read_text().splitlines(), (ref / "hashes.jsonl").read_text().splitlines()]
    report.hashes_identical = hashes[0] == hashes[1] and len(hashes[0]) == len(rows)
    report.resumed_from_the_newest = bool(report.launch_log) and all(resumed_as_expected(e) for e in report.launch_log)


def resumed_as_expected(entry: dict) -> bool:
    """A launch resumed from the newest committed checkpoint there was when it started (it started
    afresh where there was none). One killed at start-up may have died before it said so."""
    expected = entry["newest_commit"] or None
    if entry["killed_at"] == "startup":
        return entry["resumed_from"] in (None, expected)
    return entry["resumed_from"] == expected


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2, choices=[1, 2])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save-steps", type=int, default=2, help="checkpoint every N rounds")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill schedule (the training seed is fixed)")
    ap.add_argument(
        "--async", dest="staleness", type=int, default=0, metavar="K", help="asynchronous generation, max_staleness K"
    )
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="plait-chaos-"))
    say = print
    try:
        model, data = setup(work)
        ref, out = work / "reference", work / "chaos"
        mode = f", async max_staleness={args.staleness}" if args.staleness else ""
        say(f"chaos: {args.nproc} process(es){mode}, {args.steps} steps, {args.kills} kills; work folder {work}")
        extra = [f"rollout.max_staleness={args.staleness}"] if args.staleness else []
        moments = ASYNC_MOMENTS if args.staleness else MOMENTS
        run_to_end(
            command(args.nproc, overrides(model, data, ref, args.steps, 0, args.save_steps) + extra),
            work,
            work / "reference.log",
        )
        say(f"reference run done ({time.monotonic() - t0:.0f}s)")
        report = Report()
        chaos_run(
            command(args.nproc, overrides(model, data, out, args.steps, 0, args.save_steps) + extra),
            work,
            out,
            args.kills,
            args.steps,
            random.Random(args.seed),
            args.nproc,
            report,
            say,
            moments,
        )
        compare(ref, out, work, report)
        report.seconds = round(time.monotonic() - t0, 1)
        say(
            f"kills: {sum(report.kills.values())} ({', '.join(f'{k} {v}' for k, v in report.kills.items())}; "
            f"in order: {', '.join(report.moments)}); "
            f"launches {report.launches}; resumes {report.resumes}"
        )
        say(
            f"corrupt checkpoints loaded: {report.corrupt_loads}; incomplete checkpoints left by kills (never loaded): "
            f"{report.incomplete_checkpoints_seen}"
        )
        say(
            f"checkpoints compared with the reference: {report.checkpoints_compared}, "
            f"differing: {report.checkpoints_differing}"
        )
        say(
            f"final weights max |diff|: {report.max_weight_diff}; "
            f"optimizer state identical: {report.optimizer_identical}; "
            f"metrics differing: {report.metrics_differing or 'none'}; "
            f"round hashes identical: {report.hashes_identical}"
        )
        say(f"chaos: {'PASS' if report.ok else 'FAIL'} in {report.seconds}s")
        if args.json:
            Path(args.json).write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=1))
        return 0 if report.ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
