"""Where every process of a job goes: the planner behind `plait plan` and `plait train --ray`.

Given the nodes (how many devices each) and a config, a `Placement` says which devices train
(ranks in node order, so a node's ranks are neighbours), which run generation replicas (each
replica's tensor-parallel devices on one node, replicas packed from the last node backwards so
generation gets whole nodes when it can), the per-process batch arithmetic, and a rough memory
estimate per device. When a config can't be placed, `plan_cluster` returns the reasons and the
nearest placements that work, each as the `--set` overrides that give it.

Everything here is pure: no Ray, no torch. The Ray launcher (plait/cluster/ray_launcher.py)
turns a Placement into placement-group bundles pinned to the planned nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.plan import BatchPlan, fits, plan_batch


@dataclass(frozen=True)
class Node:
    name: str  # what the user sees: "node 0", or the node's address on a live cluster
    devices: int
    node_id: str | None = None  # Ray's node id: bundles are pinned to it
    address: str | None = None


@dataclass(frozen=True)
class Slot:
    node: int  # index into Placement.nodes
    device: int  # device index on that node


@dataclass
class Placement:
    nodes: list[Node]
    train: list[Slot]  # index = training rank
    replicas: list[list[Slot]]  # each generation replica's tensor-parallel devices (one node)
    batch: BatchPlan
    backend: str
    generation: str  # "hf", "vllm colocate", "vllm server" (plait starts replicas) or "vllm external"
    device_kind: str = "GPU"
    memory: "MemoryEstimate | None" = None
    notes: list[str] = field(default_factory=list)

    @property
    def tensor_parallel(self) -> int:
        return len(self.replicas[0]) if self.replicas else 0

    def as_dict(self) -> dict:
        """What the launcher records in RUN_DIR/placement.json."""

        def slot(s: Slot) -> dict:
            n = self.nodes[s.node]
            return {"node": n.name, "node_id": n.node_id, "device": s.device}

        return {
            "trainers": [dict(rank=r, **slot(s)) for r, s in enumerate(self.train)],
            "generation_replicas": [[slot(s) for s in rep] for rep in self.replicas],
            "backend": self.backend,
            "generation": self.generation,
        }


@dataclass(frozen=True)
class Alternative:
    overrides: tuple[str, ...]  # --set KEY=VALUE that give it
    summary: str
    distance: tuple


# ---------------------------------------------------------------- devices


def place(nodes: list[Node], n_train: int, tp: int, dp: int) -> tuple[list[Slot], list[list[Slot]]] | str:
    """Devices for `dp` generation replicas of `tp` devices and `n_train` trainers, or why not.

    Replicas first, from the last node backwards, each on one node (vLLM's tensor parallelism
    stays inside a node); then trainers fill the remaining devices in node order."""
    free = [list(range(n.devices)) for n in nodes]
    replicas: list[list[Slot]] = []
    for i in reversed(range(len(nodes))):
        while len(replicas) < dp and len(free[i]) >= tp:
            taken, free[i] = free[i][-tp:], free[i][:-tp]
            replicas.append([Slot(i, d) for d in taken])
    if len(replicas) < dp:
        widest = max((n.devices for n in nodes), default=0)
        if tp > widest:
            return (
                f"a generation replica needs tensor_parallel_size={tp} devices on one node, but the largest node "
                f"has {widest}; use rollout.vllm.tensor_parallel_size <= {widest}"
            )
        return (
            f"{dp} generation replicas x {tp} devices don't fit on whole nodes of "
            f"{'/'.join(str(n.devices) for n in nodes)} devices"
        )
    replicas.sort(key=lambda r: (r[0].node, r[0].device))
    train = [Slot(i, d) for i in range(len(nodes)) for d in free[i]][:n_train]
    if len(train) < n_train:
        total = sum(n.devices for n in nodes)
        return f"{n_train} training + {dp * tp} generation devices = {n_train + dp * tp}, but the cluster has {total}"
    return train, replicas


def take_devices(nodes: list[Node], devices: int | None) -> list[Node]:
    """The first `devices` devices of the cluster, in node order (all of them for None)."""
    if devices is None:
        return list(nodes)
    out, left = [], devices
    for n in nodes:
        if left <= 0:
            break
        out.append(Node(n.name, min(n.devices, left), n.node_id, n.address))
        left -= n.devices
    return out


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    hidden: int
    vocab: int

    @property
    def label(self) -> str:
        return f"{self.params / 1e9:.2f}B" if self.params >= 1e9 else f"{self.params / 1e6:.1f}M"


def model_shape(name_or_path: str) -> ModelShape | None:
    """Parameter count and shape from the model's config.json, counted on the meta device
    (exact for any architecture, nothing allocated); None when the model isn't here."""
    import json

    from plait.models import resolve_model_path

    try:
        folder = resolve_model_path(name_or_path)
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    text = raw.get("text_config", raw)
    return ModelShape(params, text.get("num_hidden_layers", 0), text.get("hidden_size", 0), text.get("vocab_size", 0))


def shape_from_count(params: float) -> ModelShape:
    """A stand-in shape for --params when the model isn't on this machine (Llama-like proportions)."""
    hidden = int(max(512, round((params / 12 / 32) ** 0.5 / 64) * 64))
    layers = max(1, int(params / (12 * hidden * hidden)))
    return ModelShape(int(params), layers, hidden, 128_256)


GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Rough bytes per device, by part. Training: weights, gradients, AdamW's two moments (all in
    model.dtype), sharded as the backend shards them; activations (~34 x hidden bytes per token
    and layer at 16 bits without checkpointing) and the fp32 logits of one micro-batch; a
    colocated vLLM's share. Generation: weights / tp, and the KV cache gets the rest."""

    shape: ModelShape
    train: dict[str, float]
    generation: dict[str, float]
    device_gb: float

    @property
    def train_total(self) -> float:
        return sum(self.train.values())

    @property
    def fits(self) -> bool:
        return self.train_total <= self.device_gb * GiB and self.generation.get("kv cache", 1) > 0


def estimate_memory(cfg, shape: ModelShape, n_train: int, tp: int, backend: str, device_gb: float) -> MemoryEstimate:
    w = 2 if cfg.model.dtype == "bfloat16" else 4
    lora = cfg.model.lora is not None
    trainable = shape.params * 0.01 if lora else shape.params  # LoRA adapters: ~1% of the weights
    weights, grads, optim = shape.params * w, trainable * w, 2 * trainable * w
    reference = shape.params * w if cfg.algo.beta > 0 and not lora else 0
    teacher = held_teacher_bytes(cfg)
    t = cfg.train
    if backend == "fsdp2":
        keep = 0 if t.fsdp.cpu_offload else 1 / n_train
        weights, grads, optim, reference = weights * keep, grads * keep, optim * keep, reference * keep
        teacher = teacher * keep
    elif backend == "deepspeed":
        ds = t.deepspeed
        grads, optim = grads / n_train, (0 if ds.offload_optimizer else optim / n_train)
        if ds.zero_stage == 3:
            weights = 0 if ds.offload_params else weights / n_train
            reference, teacher = reference / n_train, teacher / n_train
    tokens = t.micro_batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_completion_length)
    act_bytes = (2 if t.precision == "bf16" else 4) / 2
    per_layer = 2 * shape.hidden if cfg.model.gradient_checkpointing else 34 * shape.hidden
    activations = tokens * shape.layers * per_layer * act_bytes
    logits = tokens * shape.vocab * 4 * 2  # fp32 logits and their gradient
    train = {"weights": weights, "gradients": grads, "optimizer": optim}
    if backend == "ddp":
        train["ddp buckets"] = grads  # DDP's gradient buckets beside the gradients
    if reference:
        train["reference"] = reference
    if teacher:
        train["teacher"] = teacher
    train |= {"activations": activations, "logits": logits}
    v = cfg.rollout.vllm
    engine_w = shape.params * (2 if t.precision == "bf16" else 4)
    if cfg.rollout.engine == "vllm" and v.mode == "colocate":
        train["vllm (colocated)"] = v.gpu_memory_utilization * device_gb * GiB
    generation = {}
    if tp:
        budget = (v.kv_cache_gb * GiB + engine_w / tp) if v.kv_cache_gb else v.gpu_memory_utilization * device_gb * GiB
        generation = {"weights": engine_w / tp, "kv cache": budget - engine_w / tp}
    return MemoryEstimate(shape, train, generation, device_gb)


def held_teacher_bytes(cfg) -> float:
    """The distillation teacher's weights in each training process (teacher.site=trainer; 0
    without a teacher, or one elsewhere, or one not on this machine)."""
    t = cfg.teacher
    if t is None or t.site != "trainer":
        return 0.0
    shape = model_shape(t.name_or_path)
    return 0.0 if shape is None else shape.params * (2 if (t.dtype or cfg.model.dtype) == "bfloat16" else 4)


def teacher_line(cfg) -> str | None:
    """Where the distillation teacher runs, for the placement (None: no teacher)."""
    t = cfg.teacher
    if t is None:
        return None
    return {
        "trainer": f"teacher: {t.name_or_path}, held in every training process beside the policy",
        "process": f"teacher: {t.name_or_path}, in its own process started by the trainer",
        "server": f"teacher: the rollout server at {t.url}",
    }[t.site]


def render_memory(m: MemoryEstimate, backend: str, n_train: int, tp: int) -> list[str]:
    def gb(x: float) -> str:
        return f"{x / GiB:.2f}" if x < 10 * GiB else f"{x / GiB:.0f}"

    parts = " + ".join(f"{k} {gb(v)}" for k, v in m.train.items())
    sharded = {"fsdp2": f" (sharded over {n_train})", "deepspeed": f" (ZeRO over {n_train})"}.get(backend, "")
    lines = [
        f"memory per device (rough estimate; model {m.shape.label} parameters, {m.device_gb:g} GiB devices):",
        f"  training{sharded}: {parts} = {gb(m.train_total)} GiB"
        + ("" if m.train_total <= m.device_gb * GiB else "  ** more than the device holds **"),
    ]
    if m.generation:
        kv = m.generation["kv cache"]
        too_big = "  ** the weights don't fit in the engine's share: raise gpu_memory_utilization or tp **"
        lines.append(
            f"  generation (tp {tp}): weights {gb(m.generation['weights'])} GiB "
            f"+ KV cache {gb(max(kv, 0))} GiB" + ("" if kv > 0 else too_big)
        )
    if m.train_total > m.device_gb * GiB:
        lines.append(
            "  to fit: train.backend=fsdp2 or deepspeed (shard), model.gradient_checkpointing=true, a smaller "
            "train.micro_batch_size, model.lora, "
            "or offloading (train.fsdp.cpu_offload / train.deepspeed.offload_*)"
        )
    return lines


# ---------------------------------------------------------------- the plan


def _generation(cfg) -> tuple[str, int, int]:
    """(how generation runs, tp, replicas plait starts)."""
    r, v = cfg.rollout, cfg.rollout.vllm
    if r.engine != "vllm":
        return "hf", 0, 0
    if v.mode == "colocate":
        return "vllm colocate", 0, 0
    if not cfg.cluster.generation_devices:
        return "vllm external", 0, 0  # servers the user started: rollout.vllm.servers
    return "vllm server", v.tensor_parallel_size, v.data_parallel_size


def _batch(cfg, n_train: int) -> BatchPlan | str:
    r, t = cfg.rollout, cfg.train
    return plan_batch(
        r.prompts_per_step,
        r.num_generations,
        t.micro_batch_size,
        t.gradient_accumulation_steps,
        n_train,
        0,
        t.auto_batch,
    )


def try_place(cfg, nodes: list[Node]) -> Placement | list[str]:
    """The placement of this config on these nodes, or its problems."""
    from plait.config import resolve_backend

    have = sum(n.devices for n in nodes)
    if cfg.cluster.devices and cfg.cluster.devices > have:
        return [
            f"cluster.devices={cfg.cluster.devices}, but the cluster has {have} devices; "
            f"use at most {have} (or null for all)"
        ]
    nodes = take_devices(nodes, cfg.cluster.devices)
    total = sum(n.devices for n in nodes)
    how, tp, dp = _generation(cfg)
    n_train = total - tp * dp
    if n_train < 1:
        return [f"generation takes {tp * dp} of {total} devices and leaves none for training"]
    where = place(nodes, n_train, tp, dp)
    problems = [where] if isinstance(where, str) else []
    batch = _batch(cfg, n_train)
    if isinstance(batch, str):
        problems.append(batch.replace(f"over {n_train} training processes", f"over {n_train} training devices"))
    if problems:
        return problems
    train, replicas = where
    backend = resolve_backend(cfg, n_train)
    return Placement(nodes, train, replicas, batch, backend, how)


def alternatives(cfg, nodes: list[Node], k: int = 4) -> list[Alternative]:
    """The nearest configs that place: another generation/training split (fewest devices moved),
    or, keeping the split, the nearest prompts_per_step / micro_batch_size that divide."""
    nodes = take_devices(nodes, cfg.cluster.devices)
    total = sum(n.devices for n in nodes)
    how, tp, dp = _generation(cfg)
    r, t = cfg.rollout, cfg.train
    out: list[Alternative] = []

    def ok(n_train: int, gen_tp: int, gen_dp: int, prompts: int, micro: int) -> bool:
        return (
            n_train >= 1
            and not isinstance(place(nodes, n_train, gen_tp, gen_dp), str)
            and fits(prompts, r.num_generations, micro, n_train, t.gradient_accumulation_steps)
        )

    want = tp * dp
    if how == "vllm server":
        for tp2 in sorted({tp, *[x for x in (1, 2, 4, 8) if x <= max(n.devices for n in nodes)]}):
            for dp2 in range(1, total // tp2):
                n_train = total - tp2 * dp2
                if (tp2, dp2) != (tp, dp) and ok(n_train, tp2, dp2, r.prompts_per_step, t.micro_batch_size):
                    sets = [f"cluster.generation_devices={tp2 * dp2}", f"rollout.vllm.data_parallel_size={dp2}"]
                    if tp2 != tp:
                        sets.append(f"rollout.vllm.tensor_parallel_size={tp2}")
                    replicas = f"{dp2} replica{'s' if dp2 > 1 else ''} x tp {tp2}"
                    out.append(
                        Alternative(
                            tuple(sets),
                            f"{n_train} train + {tp2 * dp2} generate ({replicas})",
                            (abs(tp2 * dp2 - want), abs(tp2 - tp), 0),
                        )
                    )
        if ok(total, 0, 0, r.prompts_per_step, t.micro_batch_size):
            out.append(
                Alternative(
                    ("rollout.vllm.mode=colocate", "cluster.generation_devices=0"),
                    f"{total} train, each with its own colocated vLLM engine",
                    (want, 0, 1),
                )
            )
    elif how in ("hf", "vllm colocate", "vllm external") and total > 1:
        for n_train in range(total - 1, 0, -1):  # fewer trainers (idle devices): the last resort
            if ok(n_train, 0, 0, r.prompts_per_step, t.micro_batch_size):
                out.append(
                    Alternative(
                        (f"cluster.devices={n_train}",),
                        f"{n_train} train ({total - n_train} device(s) left idle)",
                        (total - n_train + want, 0, 2),
                    )
                )
                break
    n_train = total - want
    split = f"{n_train} train + {want} generate" if want else f"{n_train} train"
    if n_train >= 1 and not isinstance(place(nodes, n_train, tp, dp), str):
        near = sorted(
            (p for p in range(1, 4 * r.prompts_per_step + n_train + 1) if ok(n_train, tp, dp, p, t.micro_batch_size)),
            key=lambda p: (abs(p - r.prompts_per_step), p),
        )[:2]
        for p in near:
            out.append(
                Alternative(
                    (f"rollout.prompts_per_step={p}",),
                    f"{split}, {p} prompts x {r.num_generations} = {p // n_train} prompt(s) per trainer",
                    (0, 0, 0, abs(p - r.prompts_per_step)),
                )
            )
        micro = [m for m in range(t.micro_batch_size, 0, -1) if ok(n_train, tp, dp, r.prompts_per_step, m)][:1]
        for m in micro:
            out.append(Alternative((f"train.micro_batch_size={m}",), f"{split}, micro-batches of {m}", (0, 0, 0, 0)))
    out.sort(key=lambda a: a.distance)
    return out[:k]


def auto_split(cfg, nodes: list[Node]) -> tuple[list[str], str]:
    """`--auto`: the overrides that pick the generation/training split for this config.

    Server mode: keep tensor_parallel_size and choose the number of replicas nearest to the one
    asked for (cluster.generation_devices), or to a quarter of the devices when none was, among
    the splits where the batch divides into whole groups per trainer. Colocated or HF
    generation: every device trains. If no split divides the batch, auto_batch fixes the batch."""
    nodes = take_devices(nodes, cfg.cluster.devices)
    total = sum(n.devices for n in nodes)
    r, t, v = cfg.rollout, cfg.train, cfg.rollout.vllm
    if r.engine != "vllm" or v.mode != "server":
        engine = f"{r.engine}{' colocate' if r.engine == 'vllm' else ''}"
        return [], f"every one of the {total} devices trains ({engine} generation runs on them)"
    tp = v.tensor_parallel_size
    target = cfg.cluster.generation_devices or max(tp, round(total / 4 / tp) * tp)
    options = [
        dp
        for dp in range(1, total // tp)
        if target / 2 <= tp * dp <= target * 2  # a split far from the target wastes more than a rounded batch
        and not isinstance(place(nodes, total - tp * dp, tp, dp), str)
        and fits(
            r.prompts_per_step, r.num_generations, t.micro_batch_size, total - tp * dp, t.gradient_accumulation_steps
        )
    ]
    if options:
        dp = min(options, key=lambda d: (abs(tp * d - target), -d))
        why = (
            f"{total - tp * dp} train + {tp * dp} generate: "
            f"the split nearest to {target} generation device(s) where the batch divides"
        )
        return [f"cluster.generation_devices={tp * dp}", f"rollout.vllm.data_parallel_size={dp}"], why
    dp = max(1, target // tp)
    return (
        [f"cluster.generation_devices={tp * dp}", f"rollout.vllm.data_parallel_size={dp}", "train.auto_batch=true"],
        f"{total - tp * dp} train + {tp * dp} generate; "
        "no split near that divides the batch, so train.auto_batch=true rounds it",
    )


def plan_cluster(
    cfg, nodes: list[Node], device_gb: float | None = None, shape: ModelShape | None = None
) -> Placement | tuple[list[str], list[Alternative]]:
    """A Placement (with a memory estimate when the model's shape is known), or (problems, alternatives)."""
    placed = try_place(cfg, nodes)
    if isinstance(placed, list):
        return placed, alternatives(cfg, nodes)
    for note in placed.batch.notes:
        placed.notes.append(note)
    if shape is not None and device_gb:
        placed.memory = estimate_memory(
            cfg, shape, len(placed.train), placed.tensor_parallel, placed.backend, device_gb
        )
    return placed


def _ranges(values: list[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def render(p: Placement, cfg) -> list[str]:
    """The placement as `plait plan` and the Ray launcher print it."""
    kind = p.device_kind
    n_train, tp = len(p.train), p.tensor_parallel
    shard = {
        "fsdp2": f"fsdp2: parameters, gradients and optimizer sharded over {n_train}",
        "deepspeed": f"deepspeed ZeRO-{cfg.train.deepspeed.zero_stage} over {n_train}",
        "ddp": f"ddp: whole weights on each of {n_train}",
        "local": "local: one process",
    }[p.backend]
    replicas = f"{len(p.replicas)} replica{'s' if len(p.replicas) > 1 else ''}"
    from plait.rollout import generation_site

    own_process = generation_site(cfg) == "process"  # the one place that decides where sampling runs
    gen = {
        "hf": "generation: the HF engine's own process, started by training rank 0 (hf)"
        if own_process
        else "generation in the training processes (hf)",
        "vllm colocate": "generation: one colocated vLLM engine per training process",
        "vllm external": f"generation: the rollout servers at {', '.join(cfg.rollout.vllm.servers)}",
        "vllm server": f"{len(p.replicas) * tp} generate (vLLM: {replicas} x tp {tp})",
    }[p.generation]
    lines = [f"placement: {n_train} train ({shard}) + {gen}"]
    teacher = teacher_line(cfg)
    if teacher:
        lines.append(f"  {teacher}")
    if p.generation == "vllm external":
        where = cfg.rollout.vllm.token_file or "~/.cache/plait/rollout-token"
        lines.append(
            f"  the servers' token: $PLAIT_ROLLOUT_TOKEN, else {where} (the server's file: copy it to training "
            "nodes that don't share it; docs/security.md)"
        )
    elif p.generation == "vllm server":
        lines.append("  the replicas' token: a fresh one per run, handed to the trainers by the launcher")
    width = max(len(n.name) for n in p.nodes)
    for i, n in enumerate(p.nodes):
        ranks = [r for r, s in enumerate(p.train) if s.node == i]
        row = []
        if ranks:
            devs = [p.train[r].device for r in ranks]
            row.append(f"{kind} {_ranges(devs)}: train rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}")
        here = [j for j, rep in enumerate(p.replicas) if rep[0].node == i]
        if here:
            devs = [s.device for j in here for s in p.replicas[j]]
            row.append(
                f"{kind} {_ranges(devs)}: generation replica{'s' if len(here) > 1 else ''} {_ranges(here)}"
                + (f" ({tp} devices each)" if tp > 1 and len(here) > 1 else "")
            )
        used = len(ranks) + sum(len(rep) for rep in p.replicas if rep[0].node == i)
        if used < n.devices:
            row.append(f"{n.devices - used} idle")
        lines.append(f"  {n.name:<{width}}  " + ("; ".join(row) or "unused"))
    b = p.batch
    lines.append(
        f"batch: {b.prompts_per_step} prompts x {b.num_generations} generations = "
        f"{b.completions_per_step} completions "
        f"per step; each trainer: {b.prompts_per_process} prompt(s) = {b.completions_per_process} completions "
        f"= {b.gradient_accumulation_steps} micro-batch(es) of {b.micro_batch_size}"
    )
    lines += p.notes
    if p.memory is not None:
        lines += render_memory(p.memory, p.backend, n_train, tp)
    return lines


def render_failure(problems: list[str], alts: list[Alternative]) -> list[str]:
    lines = ["this config can't be placed:"] + [f"  - {p}" for p in problems]
    if alts:
        lines.append("placements that work (nearest first):")
        for a in alts:
            lines.append(f"  {a.summary}:  " + " ".join(f"--set {o}" for o in a.overrides))
    else:
        lines.append("no nearby placement works: change rollout.prompts_per_step or the number of devices")
    return lines


def uniform_nodes(nodes: int, per_node: int) -> list[Node]:
    return [Node(f"node {i}", per_node) for i in range(nodes)]
