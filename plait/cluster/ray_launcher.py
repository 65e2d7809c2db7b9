"""`plait train --ray`: run a job on a Ray cluster, no placement code from the user.

The driver (the `plait train` process, on any node of the cluster, or `ray job submit`'s):

1. connects to the cluster and reads its nodes (`ray.nodes()`), plans the placement
   (plait/cluster/placement.py) and validates the config against it, before anything loads;
2. reserves one placement group whose bundles are pinned to the planned nodes (label
   `ray.io/node-id`), so every process lands where the plan said;
3. starts the generation replicas as actors (each runs a `plait.rollout.server` process on its
   devices) and waits until they answer, then the trainers as actors that set torchrun's
   environment (RANK, WORLD_SIZE, MASTER_ADDR = rank 0's node...) and run the same `train()` a
   torchrun process runs; their output reaches the driver through Ray's log streaming, each
   line prefixed with the actor's role;
4. waits; the first trainer or replica that fails stops the job: it is reported with its role,
   node and cause, every actor is killed and the placement group released (also on Ctrl-C or
   SIGTERM, e.g. `ray job stop`). With cluster.max_restarts > 0 the whole job is started
   again (a torch.distributed group can't replace one member) and resumes from the last
   committed checkpoint.

The run directory must be on storage every node sees (rank 0 writes metrics and the export,
every rank writes its checkpoint shards); on one machine, as in the tests, it always is.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from plait.cluster.placement import Node, Placement, model_shape, plan_cluster, render, render_failure
from plait.comm import free_port
from plait.config import Config, ConfigError
from plait.train.determinism import pinned_environment


# environment every actor gets from the driver (besides cluster.ray.env)
# TORCHINDUCTOR_CACHE_DIR: a capped run compiles apart from native ones (determinism.separate_kernel_cache)
FORWARDED = ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "HF_HOME", "PLAIT_HOME", "TORCHINDUCTOR_CACHE_DIR")


def ray_problems(cfg: Config) -> list[str]:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return ["cluster.launcher=ray needs Ray: `pip install -e '.[ray]'` (make setup installs it); docs/cluster.md"]
    from importlib.metadata import version

    have = version("ray")
    if tuple(int(x) for x in have.split(".")[:2] if x.isdigit()) < (2, 50):
        return [
            f"cluster.launcher=ray needs Ray >= 2.50 (placement bundles pinned to nodes by label), this is {have}: "
            "`pip install -U 'ray[default]>=2.50'` here and on the cluster"
        ]
    return []


def connect(address: str) -> bool:
    """Join the cluster; True when this call started Ray (then the driver shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    # Under `ray job submit` the job's own runtime env reaches every actor already, and Ray
    # refuses a driver runtime env that names one of its variables again.
    job_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env", {}).get("env_vars", {})
    forwarded = (*FORWARDED, *pinned_environment())  # train.deterministic's pins, when set
    env_vars = {k: v for k, v in os.environ.items() if (k.startswith("PLAIT_") or k in forwarded) and k not in job_env}
    runtime_env = {"env_vars": env_vars}
    try:
        if address == "local":
            ray.init(include_dashboard=False, runtime_env=runtime_env, logging_level="WARNING")
        else:
            # "auto": RAY_ADDRESS, else the cluster `ray start` joined
            ray.init(address=address, runtime_env=runtime_env, logging_level="WARNING")
    except ConnectionError as e:
        raise ConfigError(
            [
                f"cluster.ray.address={address!r}: no Ray cluster found ({e}). "
                "Start one with `ray start --head` "
                "(and `ray start --address HEAD:6379` on the other nodes), "
                "submit with `ray job submit -- plait train ...`, "
                "or set cluster.ray.address=local to start a one-machine Ray here"
            ]
        ) from None
    return True


def device_resource(cfg: Config, totals: dict) -> str:
    want = cfg.cluster.ray.device_resource
    if want != "auto":
        return want
    return "GPU" if totals.get("GPU", 0) > 0 else "CPU"


def cluster_nodes(cfg: Config) -> tuple[list[Node], str]:
    """The cluster's alive nodes (head first, then by address) and what a device is on them."""
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    totals: dict = {}
    for n in alive:
        for k, v in n["Resources"].items():
            totals[k] = totals.get(k, 0) + v
    kind = device_resource(cfg, totals)
    if kind not in totals:
        have = sorted(k for k in totals if not k.startswith(("node:", "memory", "object_store")))
        raise ConfigError(
            [
                f"cluster.ray.device_resource={kind!r}: no node of the cluster has it "
                f"(it has: {', '.join(have)}); use GPU, CPU, or one of those"
            ]
        )
    cpus = cfg.cluster.ray.cpus_per_process
    alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeManagerAddress"], n["NodeID"]))
    nodes = []
    for i, n in enumerate(alive):
        res = n["Resources"]
        if kind == "CPU":
            devices = int(res.get("CPU", 0) // cpus)
        else:
            devices = int(min(res.get(kind, 0), res.get("CPU", 0) // cpus))
        if devices:
            nodes.append(Node(f"node {i} ({n['NodeManagerAddress']})", devices, n["NodeID"], n["NodeManagerAddress"]))
    return nodes, kind


def make_plan(cfg: Config, nodes: list[Node], kind: str) -> Placement:
    """The placement, with every config problem checked against it; ConfigError otherwise."""
    from plait.config import validate

    placed = plan_cluster(cfg, nodes)
    if not isinstance(placed, Placement):
        raise ConfigError(render_failure(*placed)[1:])
    placed.device_kind = kind
    total = len(placed.train) + sum(len(r) for r in placed.replicas)
    checked = cfg.model_copy(deep=True)
    checked.cluster.devices = total
    validate(checked, world_size=len(placed.train))
    return placed


# ---------------------------------------------------------------- actors


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the actor process dies, even by SIGKILL."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Trainer:
    """One training process: torchrun's environment, then the same `train()`."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        # Ray shows each actor only its one device
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")

    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "port": free_port(""),
        }

    def run(self, cfg_json: str, master: str, port: int, console: str | None, token: str | None) -> dict:
        """`token`: the generation replicas' token when this job started them (it reaches the
        trainer through its environment, never the config written to the run directory)."""
        import ray

        from plait.auth import ENV

        node_id = ray.get_runtime_context().get_node_id()
        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), PLAIT_NODE_ID=node_id)
        if token:
            os.environ[ENV] = token
        from plait.config import Config
        from plait.train.loop import train

        result = train(Config.model_validate_json(cfg_json), console=console)
        return {"run_dir": str(result.run_dir), "steps": len(result.history)}

    def __repr__(self) -> str:  # Ray's prefix for this actor's log lines
        return f"trainer rank {self.rank}"


class GenerationServer:
    """One generation replica: a `plait.rollout.server` process on this actor's devices.
    Threaded (max_concurrency 2), so `stop` can run while `watch` waits on the process."""

    def __init__(self, index: int):
        self.index, self.proc = index, None

    def start(self, engine_kwargs: dict, timeout_s: float, token: str) -> str:
        """Listens on all interfaces (trainers on other nodes reach it), so requests need `token`."""
        import ray

        from plait.rollout import replica

        port = free_port("")
        env = {}
        if not ray.get_gpu_ids():  # CPU: the replica's workers get this node's cores, as `plait rollout-server` does
            env = replica.cpu_threads(0, engine_kwargs.get("tensor_parallel_size", 1), 1)
        self.proc = replica.start(engine_kwargs, 0, "0.0.0.0", [port], token, env, preexec_fn=_die_with_parent)
        replica.wait_healthy([f"http://127.0.0.1:{port}"], [self.proc], timeout_s)
        return {
            "url": f"http://{ray.util.get_node_ip_address()}:{port}",
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def watch(self) -> int:
        """Returns only when the replica process ends (its exit code)."""
        return self.proc.wait() if self.proc is not None else 0

    def stop(self) -> None:
        from plait.rollout import replica

        if self.proc is not None:
            replica.stop(self.proc)

    def __repr__(self) -> str:
        return f"generation replica {self.index}"


# ---------------------------------------------------------------- one attempt


@dataclass
class Failure:
    who: str
    node: str
    why: str
    error: BaseException | None = None  # a plait error raised by a trainer (config, data, reward...)

    @property
    def restartable(self) -> bool:
        from plait.data import DataError
        from plait.rewards.runner import RewardError
        from plait.sandbox import SandboxUnavailable
        from plait.train.guard import TrainingDiverged

        # these would fail the same way again: a restart only repeats them
        return not isinstance(self.error, (ConfigError, DataError, RewardError, SandboxUnavailable, TrainingDiverged))


def _why(err: BaseException) -> str:
    """A Ray error's cause in one line (the full text is in the driver's log above).

    Ray's text for a worker that vanished lists "the OOM killer" among *possible* causes,
    so only Ray's own memory monitor (OutOfMemoryError) is reported as out of memory."""
    import ray.exceptions as rex

    text = str(err)
    if isinstance(err, rex.OutOfMemoryError) or "running low on memory" in text:
        return "Ray's memory monitor killed it: the node ran out of memory"
    if isinstance(err, getattr(rex, "NodeDiedError", ())) or "node has died" in text or "node was terminated" in text:
        return "its node died or left the cluster"
    if isinstance(err, rex.ActorDiedError) or "Worker unexpectedly exits" in text:
        return (
            "its process died without a Python error (killed by a signal, the kernel's OOM killer, "
            "or a native crash; see the node's dmesg and Ray's worker log)"
        )
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    return first or type(err).__name__


class Job:
    """One attempt: placement group, replicas, trainers; `run` until done or a failure."""

    def __init__(self, cfg: Config, plan: Placement, say):
        self.cfg, self.plan, self.say = cfg, plan, say
        self.pg = None
        self.servers: list = []
        self.token: str | None = None  # the replicas' token, fresh per attempt
        self.trainers: list = []
        self.ran_on: dict[str, list[str]] = {}  # node ids Ray reports for each actor
        self.where_trainers: list[dict] = []

    def _bundles(self) -> tuple[list[dict], list[dict]]:
        r = self.cfg.cluster.ray
        kind, cpus = self.plan.device_kind, r.cpus_per_process

        def bundle(n_devices: int) -> dict:
            if kind == "CPU":
                return {"CPU": cpus * n_devices}
            return {kind: float(n_devices), "CPU": cpus}

        slots = [[s] for s in self.plan.train] + self.plan.replicas
        bundles = [bundle(len(s)) for s in slots]
        selectors = [{"ray.io/node-id": self.plan.nodes[s[0].node].node_id} for s in slots]
        return bundles, selectors

    def _options(self, index: int, n_devices: int, name: str) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        kind, cpus = self.plan.device_kind, self.cfg.cluster.ray.cpus_per_process
        opts = {
            "num_cpus": cpus * n_devices if kind == "CPU" else cpus,
            "max_restarts": 0,
            "name": name,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
            "runtime_env": {"env_vars": dict(self.cfg.cluster.ray.env)},
        }
        if kind == "GPU":
            opts["num_gpus"] = n_devices
        elif kind != "CPU":
            opts["resources"] = {kind: n_devices}
        return opts

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        r = self.cfg.cluster.ray
        bundles, selectors = self._bundles()
        self.pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
        try:
            ray.get(self.pg.ready(), timeout=r.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the cluster did not grant the placement ({len(bundles)} bundles: {bundles}) within "
                f"{r.start_timeout_s:.0f} s (cluster.ray.start_timeout_s): "
                "other jobs hold the devices?"
            ) from None
        n = len(self.plan.train)
        tag = f"plait-{os.getpid()}-{time.time_ns() % 10**6}"
        if self.plan.replicas:
            self._start_servers(n, tag)
        trainer_cls = ray.remote(Trainer)
        self.trainers = [
            trainer_cls.options(**self._options(i, 1, f"{tag}-trainer-{i}")).remote(i, n) for i in range(n)
        ]
        self.where_trainers = ray.get([t.where.remote() for t in self.trainers])
        self.ran_on["trainers"] = [w["node_id"] for w in self.where_trainers]
        planned = {
            "trainers": [self.plan.nodes[s.node].node_id for s in self.plan.train],
            "generation_replicas": [self.plan.nodes[r[0].node].node_id for r in self.plan.replicas],
        }
        for role, ids in self.ran_on.items():  # the bundles' node labels guarantee it; say so if Ray ever disagrees
            for i, (want, got) in enumerate(zip(planned[role], ids)):
                if want != got:
                    self.say(f"warning: {role} {i} runs on node {got[:8]}, not on the planned {want[:8]}")

    def record(self, run_dir: Path) -> None:
        """RUN_DIR/placement.json: the plan, and where Ray actually started each actor."""
        (run_dir / "placement.json").write_text(json.dumps({**self.plan.as_dict(), "ran_on": self.ran_on}, indent=1))

    def _start_servers(self, first_bundle: int, tag: str) -> None:
        import ray

        from plait.models import resolve_model_path
        from plait.rollout.vllm_engine import engine_kwargs
        from plait.train.backends import resolve_device

        tp = self.plan.tensor_parallel
        server_cls = ray.remote(GenerationServer)
        self.servers = [
            server_cls.options(
                max_concurrency=2, **self._options(first_bundle + j, tp, f"{tag}-generation-{j}")
            ).remote(j)
            for j in range(len(self.plan.replicas))
        ]
        device = resolve_device("cuda" if self.plan.device_kind == "GPU" else "cpu")
        kwargs = engine_kwargs(self.cfg, str(resolve_model_path(self.cfg.model.name_or_path)), device, tp)
        from plait.auth import new_token

        self.token = new_token()
        timeout = self.cfg.cluster.ray.start_timeout_s
        started = ray.get([s.start.remote(kwargs, timeout, self.token) for s in self.servers])
        self.ran_on["generation_replicas"] = [s["node_id"] for s in started]
        urls = [s["url"] for s in started]
        self.cfg = self.cfg.model_copy(deep=True)
        self.cfg.rollout.vllm.servers = urls
        self.say(f"generation replicas ready: {', '.join(urls)}")

    def where(self, actor_index: int) -> str:
        return self.plan.nodes[self.plan.train[actor_index].node].name

    def run(self, console: str | None) -> Failure | None:
        import ray

        master, port = self.where_trainers[0]["address"], self.where_trainers[0]["port"]
        cfg_json = self.cfg.model_dump_json()
        pending = {
            t.run.remote(cfg_json, master, port, console if i == 0 else "none", self.token): ("trainer", i)
            for i, t in enumerate(self.trainers)
        }
        pending |= {s.watch.remote(): ("generation", j) for j, s in enumerate(self.servers)}
        trainers_left = len(self.trainers)
        while trainers_left:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            failure = self._outcome(ref, pending.pop(ref))
            if failure is None:
                trainers_left -= 1
                continue
            # one death makes the others' collectives fail within moments: wait a little and
            # report the root cause (a dead process before an error it caused elsewhere)
            more, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.GRACE_S)
            failures = [failure] + [f for r in more if (f := self._outcome(r, pending.pop(r))) is not None]
            failures.sort(key=lambda f: (f.error is not None, not f.restartable))
            if len(failures) > 1:
                failures[0].why += f" (then {', '.join(f.who for f in failures[1:])} failed too)"
            return failures[0]
        return None

    GRACE_S = 5.0

    def _outcome(self, ref, what: tuple[str, int]) -> Failure | None:
        """None for a trainer that finished; the Failure of one that didn't, or of a replica."""
        import ray

        role, i = what
        node = self.where(i) if role == "trainer" else self.plan.nodes[self.plan.replicas[i][0].node].name
        who = f"trainer rank {i}" if role == "trainer" else f"generation replica {i}"
        try:
            value = ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # the code raised: the cause is ours
            cause = e.cause if isinstance(e.cause, BaseException) else e
            return Failure(who, node, f"{type(cause).__name__}: {cause}", cause)
        except ray.exceptions.RayActorError as e:  # the process or its node died
            return Failure(who, node, _why(e))
        if role == "generation":
            return Failure(who, node, f"its vLLM server process exited with code {value}")
        return None

    def teardown(self) -> None:
        """Stop replicas (their process groups), kill every actor, release the devices."""
        import ray
        from ray.util.placement_group import remove_placement_group

        stops = [s.stop.remote() for s in self.servers]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=30)
        for a in self.servers + self.trainers:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        if self.pg is not None:
            remove_placement_group(self.pg)


# ---------------------------------------------------------------- the driver


def _raise_on_sigterm() -> None:
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if sys.platform != "win32":
        signal.signal(signal.SIGTERM, handler)


def _fixed_run_dir(cfg: Config) -> Config:
    """One absolute run directory for every attempt and every node (rank 0's clock would
    otherwise name a new one per restart)."""
    from plait.train.rundir import default_run_dir

    cfg = cfg.model_copy(deep=True)
    cfg.output_dir = str(default_run_dir(cfg).resolve())
    from plait.models import DEFAULT_MODEL

    if cfg.model.name_or_path != DEFAULT_MODEL and Path(cfg.model.name_or_path).exists():
        cfg.model.name_or_path = str(Path(cfg.model.name_or_path).resolve())
    return cfg


def launch(cfg: Config, console: str | None = None, auto: bool = False, say=print) -> int:
    """Run `cfg` on the Ray cluster; the exit code. Config problems raise ConfigError."""
    import ray

    problems = ray_problems(cfg)
    if problems:
        raise ConfigError(problems)
    started = connect(cfg.cluster.ray.address)
    _raise_on_sigterm()
    cfg = _fixed_run_dir(cfg)
    attempt = 0
    try:
        while True:
            nodes, kind = cluster_nodes(cfg)
            if auto:
                from plait.cluster.placement import auto_split
                from plait.config import with_overrides

                sets, why = auto_split(cfg, nodes)
                cfg = with_overrides(cfg, sets)
                say(f"plait --auto: {why}" + (f" ({' '.join(sets)})" if sets else ""))
            plan = make_plan(cfg, nodes, kind)
            shape = model_shape(cfg.model.name_or_path)
            say(
                f"ray cluster: {len(nodes)} node(s), {sum(n.devices for n in nodes)} {kind} device(s)"
                + (f"; model {shape.label} parameters" if shape else "")
            )
            for line in render(plan, cfg):
                say(line)
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            job = Job(cfg, plan, say)
            try:
                job.start()
                job.record(Path(cfg.output_dir))
                failure = job.run(console)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError, RuntimeError) as e:
                cause = getattr(e, "cause", None)
                failure = Failure("job start", "-", f"{type(cause or e).__name__}: {_why(cause or e)}", cause)
            finally:
                job.teardown()
            if failure is None:
                say(f"ray job done: {cfg.output_dir}")
                return 0
            say(f"plait: {failure.who} on {failure.node} failed: {failure.why}")
            if not failure.restartable:
                raise failure.error
            if attempt >= cfg.cluster.max_restarts:
                say(
                    f"plait: giving up (cluster.max_restarts={cfg.cluster.max_restarts}); committed checkpoints in "
                    f"{cfg.output_dir} resume with `plait train --ray --resume {cfg.output_dir}`"
                )
                return 1
            attempt += 1
            cfg = cfg.model_copy(deep=True)
            cfg.resume = "auto"
            say(f"plait: restarting the job ({attempt}/{cfg.cluster.max_restarts}), resuming from the last checkpoint")
    except KeyboardInterrupt:
        say("plait: interrupted; actors stopped")
        return 130
    finally:
        if started:
            ray.shutdown()
