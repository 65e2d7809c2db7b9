"""Where a round's scored groups come from.

Synchronous (`rollout.max_staleness: 0`): each round generates and scores its groups when it
starts, with the weights the previous round left (`SyncRollouts`).

Asynchronous (k >= 1, docs/async.md): training rank 0 runs a `Producer` thread that generates
and scores rounds ahead of the trainer, on a generation engine outside the training process (a
vLLM rollout server, or the HF engine's own generation process). The schedule is fixed:

    round t is generated with the weights after round  scheduled_version(t, k) = max(0, t - 1 - k)

so the producer is never more than k rounds ahead, every sample is trained at most k versions
after the one that sampled it, and a run is reproducible from its seed whatever the timing.
After round t's update the trainer *publishes* version t (a CPU copy of the full weights; a
collective, since sharded backends gather); the producer pushes it to the engine just before it
generates the first round scheduled on it. With `rollout.inflight_updates` a pusher thread sends
each version as soon as it is published, and the engine swaps it in between tokens.

Rank 0 produces every process's share of a round (each process's own prompt order, exactly as
each would take them synchronously) and hands each its share at the start of the round.
A checkpoint after round s holds the rounds already generated for s+1 .. s+k (`pending`), with
the data position after them, so a resumed run trains exactly the samples an unbroken one does.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Protocol

import torch

from plait import comm
from plait.data import PromptOrder
from plait.rollout.precision import rollout_precision
from plait.rollout.remote import remote_engine
from plait.rollout.weights import adapter_part, adapter_weights, full_weights
from plait.telemetry import PhaseTimer
from plait.train.sampling import Sampler, SamplingStats
from plait.types import Group


def scheduled_version(round_: int, k: int) -> int:
    """The weight version (rounds trained) round `round_` is generated with."""
    return max(0, round_ - 1 - k)


@dataclass
class Rollout:
    """One round's scored groups, as the producer made them."""

    step: int  # the round (the field's name is what checkpoints' rollouts.pt hold)
    version: int  # the weights it was scheduled on
    shares: list[tuple[list[Group], SamplingStats]]  # each training process's groups
    consumed: list[int]  # each process's data position after this round's prompts
    seconds: dict[str, float] = field(default_factory=dict)  # the producer's phases for it
    pushes: int = 0  # weight versions sent to the engine while it was made
    sync: dict[str, float] = field(default_factory=dict)  # the last push's size and speed (weight_sync/*)


@dataclass
class RoundBatch:
    """What a rollout source hands the trainer for one round: this process's scored groups,
    how their sampling went, and the source's own metrics (async/*, weight_sync/*)."""

    groups: list[Group]
    sampling: SamplingStats
    sampled_version: int  # the weights (rounds trained) it was sampled with
    info: dict[str, float] = field(default_factory=dict)


@dataclass
class SourceState:
    """What a checkpoint after a round holds of its rollout source: the rounds already
    generated for the next ones, and every process's data position after them (None: each
    process's own position, nothing generated ahead)."""

    ahead: list[Rollout] = field(default_factory=list)
    consumed: list[int] | None = None


class RolloutSource(Protocol):
    """Where `train_round` gets its rounds. Chosen once, by `make_rollout_source`."""

    def start(self) -> None:
        """Before the first round (async: rank 0 starts the producer)."""

    def take(self, round_: int) -> RoundBatch:
        """Round `round_`'s groups for this process (generated now, or waited for)."""

    def publish(self, round_: int) -> None:
        """After round `round_`'s update: its weights, for rounds that will be sampled with them."""

    def state(self, round_: int) -> SourceState:
        """For a checkpoint after round `round_` (rank 0's answer counts)."""

    def load_state(self, state: SourceState) -> None:
        """From a checkpoint, before `start`."""

    def close(self) -> None:
        """Stop generating; free the engine this source owns."""


def make_rollout_source(run, make_generator) -> RolloutSource:
    """Rounds generated ahead of the trainer by a producer (asynchronous runs, or the HF
    engine's generation process), or generated when each round starts. `make_generator`:
    () -> (engine, program, close), rank 0's generation engine and rollout program for the producer."""
    from plait.rollout import ahead_of_trainer

    return AsyncRollouts(run, make_generator) if ahead_of_trainer(run.cfg) else SyncRollouts(run)


def staleness(groups: list[Group], trained_version: int) -> list[int]:
    """Versions between the weights that sampled each token (or completion) and the ones it is
    trained at."""
    return [trained_version - v for g in groups for c in g.completions for v in c.staleness_versions]


class SyncRollouts:
    """Generate and score each round when it starts (after the rounds a checkpoint of an async
    run held, when resuming one synchronously)."""

    def __init__(self, run):
        self.run = run
        self.ahead: dict[int, Rollout] = {}

    def start(self) -> None:
        pass

    def take(self, round_: int) -> RoundBatch:
        run = self.run
        if round_ in self.ahead:
            ahead = self.ahead.pop(round_)
            return RoundBatch(*ahead.shares[comm.rank()], ahead.version)
        with ExitStack() as weights:
            with run.timer("weight_sync"):  # HF: gather sharded weights once for the round; vLLM: copy them in
                weights.enter_context(run.engine.weights_for_round(round_ - 1))
            sampler = Sampler(run.engine, run.program, run.cfg, run.rewards, run.timer, run.sandbox)
            groups, sampling = sampler.collect(run.take_prompts, run.prompts_per_round, round_)
        return RoundBatch(groups, sampling, round_ - 1)

    def publish(self, round_: int) -> None:
        pass

    def state(self, round_: int) -> SourceState:
        """Nothing is generated ahead: the checkpoint holds no rounds, and the data positions are
        the processes' own."""
        return SourceState()

    def load_state(self, state: SourceState) -> None:
        self.ahead = {r.step: r for r in state.ahead}

    def close(self) -> None:
        pass


class Producer:
    """Rank 0's generation thread: produces rounds first..last on the schedule, waiting for each
    round's weight version to be published. Errors (a dead generation server, a failing reward)
    are kept and raised in the trainer by the next `get`/`wait`."""

    def __init__(self, run, engine, program, orders: list[PromptOrder], first: int, last: int):
        self.run, self.engine, self.program, self.orders = run, engine, program, orders
        self.k = run.cfg.rollout.max_staleness
        self.inflight = run.cfg.rollout.inflight_updates
        self.first, self.last = first, last
        self.cond = threading.Condition()
        self.snapshots: dict[int, list] = {}  # published versions not yet pushed
        self.produced: dict[int, Rollout] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.pushes = 0
        self.engine_version: int | None = None
        self.threads = [threading.Thread(target=self._guard(self._produce), name="plait-producer", daemon=True)]
        if self.inflight:
            self.threads.append(threading.Thread(target=self._guard(self._push_loop), name="plait-pusher", daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    # ---------------------------------------------------------- the trainer's side

    def publish(self, version: int, weights: list) -> None:
        with self.cond:
            self.snapshots[version] = weights
            self.cond.notify_all()

    def get(self, round_: int) -> Rollout:
        with self.cond:
            self._wait(lambda: round_ in self.produced)
            return self.produced.pop(round_)

    def wait(self, steps: range) -> list[Rollout]:
        """Rounds `steps`, once produced (they stay queued for `get`)."""
        with self.cond:
            self._wait(lambda: all(s in self.produced for s in steps))
            return [self.produced[s] for s in steps]

    def put(self, rollouts: list[Rollout]) -> None:
        """Rounds a checkpoint held (generated before the restart)."""
        with self.cond:
            self.produced.update({r.step: r for r in rollouts})

    def _wait(self, ready) -> None:
        while not ready():
            if self.error is not None:
                raise self.error
            if not any(t.is_alive() for t in self.threads) and not ready():
                raise RuntimeError("the rollout producer stopped before producing the round the trainer needs")
            self.cond.wait(timeout=1.0)

    def close(self) -> None:
        """Stop producing (a round in progress is abandoned: its request fails or finishes
        unread; the threads are daemons and hold nothing a checkpoint needs)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)

    # ---------------------------------------------------------- the thread

    def _guard(self, work):
        def run():
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - raised in the trainer by get()/wait()
                with self.cond:
                    self.error = err
                    self.cond.notify_all()

        return run

    def _next_snapshot(self, ready) -> tuple[int, list] | None:
        """Wait for a published version `ready(version)` accepts; None when stopping."""
        with self.cond:
            while True:
                if self.stopping:
                    return None
                found = [v for v in self.snapshots if ready(v)]
                if found:
                    v = max(found)
                    for old in [x for x in self.snapshots if x < v]:  # never needed again
                        del self.snapshots[old]
                    return v, self.snapshots.pop(v)
                self.cond.wait()

    def _push(self, version: int, weights: list) -> None:
        self.engine.push_weights(weights, version)
        with self.cond:
            self.engine_version = version
            self.pushes += 1
            self.cond.notify_all()

    def _push_loop(self) -> None:
        """In-flight updates: every published version goes out at once."""
        while True:
            got = self._next_snapshot(lambda v: True)
            if got is None:
                return
            self._push(*got)

    def _produce(self) -> None:
        cfg = self.run.cfg
        timer = PhaseTimer()
        for round_ in range(self.first, self.last + 1):
            need = scheduled_version(round_, self.k)
            got = None
            with timer("wait_for_weights"):
                if self.inflight:  # the pusher sends them; wait until the engine holds `need` or newer
                    with self.cond:
                        while not self.stopping and (self.engine_version is None or self.engine_version < need):
                            self.cond.wait()
                elif self.engine_version != need:
                    got = self._next_snapshot(lambda v: v == need)
            if self.stopping:
                return
            pushes_before = self.pushes
            if got is not None:
                with timer("weight_push"):
                    self._push(*got)
            sampler = Sampler(self.engine, self.program, cfg, self.run.rewards, timer, self.run.sandbox)
            shares = [
                sampler.collect(
                    lambda n, order=order: [self.run.prompts[i] for i in order.take(n)],
                    self.run.prompts_per_round,
                    round_,
                )
                for order in self.orders
            ]
            seconds = {k.removeprefix("time/"): v for k, v in timer.reset().items()}
            pushed = self.pushes - pushes_before
            sync = self.engine.stats() if pushed else {}
            rollout = Rollout(round_, need, shares, [o.consumed for o in self.orders], seconds, pushed, sync)
            with self.cond:
                self.produced[round_] = rollout
                self.cond.notify_all()


class AsyncRollouts:
    """The trainer's side of asynchronous generation (every process; rank 0 owns the producer)."""

    def __init__(self, run, make_engine):
        self.run = run
        self.make_engine = make_engine  # () -> (engine, program, close): rank 0's generation engine and its program
        self.producer: Producer | None = None
        self.restored: tuple[list[Rollout], list[int]] | None = None
        self.taken_consumed: list[int] | None = None  # data positions after the last round taken
        self.close_engine = None
        # the dtype pushes travel in: the generation engine's own
        self.dtype = torch.bfloat16 if rollout_precision(run.cfg, run.backend.device) == "bf16" else torch.float32
        self.adapters: bool | None = None  # does each push send the LoRA adapter alone (decided at the first)

    def load_state(self, state: SourceState) -> None:
        self.restored = (state.ahead, state.consumed)

    def start(self) -> None:
        """Rank 0: start the generation engine and the producer; everyone: publish the current
        weights (the version of the first rounds to produce)."""
        run = self.run
        last = run.cfg.train.max_steps
        rollouts, consumed = self.restored or ([], [run.order.consumed] * comm.world_size())
        if comm.is_main():
            world = comm.world_size()
            orders = [
                PromptOrder(len(run.prompts), run.cfg.seed, run.cfg.data.shuffle, consumed[r], rank=r, stride=world)
                for r in range(world)
            ]
            engine, program, self.close_engine = self.make_engine()
            first = run.start + 1 + len(rollouts)
            self.producer = Producer(run, engine, program, orders, first, last)
            self.producer.put(rollouts)
            self.producer.start()
        self.taken_consumed = consumed
        if run.start < last:
            self._publish(run.start)

    def take(self, round_: int) -> RoundBatch:
        """This process's share of round `round_`, waiting for the producer if it is behind."""
        with self.run.timer("wait_for_rollout"):
            rollout = self.producer.get(round_) if comm.is_main() else None
            rollout = comm.broadcast_object(rollout)
        self.taken_consumed = rollout.consumed
        groups, sampling = rollout.shares[comm.rank()]
        info = {f"async/seconds_{k}": v for k, v in rollout.seconds.items() if k not in ("step", "idle")}
        waited = rollout.seconds.get("wait_for_weights", 0.0)
        info["async/generator_idle_share"] = waited / max(1e-9, rollout.seconds.get("step", 0.0))
        info["async/weight_pushes"] = float(rollout.pushes)
        info["async/scheduled_version"] = float(rollout.version)
        info.update(rollout.sync)
        return RoundBatch(groups, sampling, rollout.version, info)

    def publish(self, round_: int) -> None:
        """After round `round_`'s update: version `round_`, if a round still to generate uses it."""
        cfg = self.run.cfg
        k, last = cfg.rollout.max_staleness, cfg.train.max_steps
        needed = round_ < last if cfg.rollout.inflight_updates else scheduled_version(last, k) >= round_
        if needed:
            with self.run.timer("weight_sync"):
                self._publish(round_)

    def _publish(self, version: int) -> None:
        # every process: gathering sharded weights (FSDP2's full_tensor) is a collective
        with self.run.backend.for_generation() as model:
            if self.adapters is None:
                engine = remote_engine(self.producer.engine) if comm.is_main() else None
                self.adapters = comm.broadcast_object(engine is not None and engine.takes_adapter(model))
            with (adapter_weights if self.adapters else full_weights)(model) as weights:
                if comm.is_main():  # an adapter's factors keep their dtype: the engine merges them as trained
                    copy = [
                        (n, t.detach().to("cpu", t.dtype if adapter_part(n) else self.dtype, copy=True))
                        for n, t in weights
                    ]
                    self.producer.publish(version, copy)

    def state(self, round_: int) -> SourceState:
        """For a checkpoint after round `round_`: the rounds generated for round_+1 .. round_+k,
        and every process's data position after them (rank 0's answer)."""
        cfg = self.run.cfg
        last = min(round_ + cfg.rollout.max_staleness, cfg.train.max_steps)
        if not comm.is_main():
            return SourceState([], [])
        held = self.producer.wait(range(round_ + 1, last + 1))
        return SourceState(held, held[-1].consumed if held else self.taken_consumed)

    def close(self) -> None:
        """Stop the producer, then the engine (a request in flight to the HF generation process
        fails at once), then give the producer a moment to notice."""
        if self.producer is not None:
            self.producer.close()
        if self.close_engine is not None:
            self.close_engine()
        if self.producer is not None:
            self.producer.join(timeout_s=10.0)
