"""The distillation teacher: a frozen model that scores every token the student sampled.

    batch (the round's samples) -> Teacher.logprobs -> [B, C] log pi_teacher(y_t)
                                -> the update: advantage + weight x (teacher - student) per token
    (teacher.top_k)             -> Teacher.top_logprobs -> also its k likeliest tokens [B, C, k]
                                -> the update: + weight x forward KL from them, a loss term

Where it runs is `teacher.site`:

    trainer   each training process holds it beside the policy, as the reference is held
              (fsdp2 and ZeRO-3 shard it): `HeldTeacher`
    process   a process of its own that loads it once and answers batches over a socket
              (`python -m plait.train.teacher`): `ProcessTeacher`
    server    `plait rollout-server --model TEACHER` (vLLM's prompt log-probs), asked over
              HTTP (POST /logprobs): `ServerTeacher`

The held teacher and its own process compute the log-probs as the reference's are (the same
plait.train.update.frozen_logprobs, with the run's config, at the sampling temperature). The
teacher is frozen, so nothing of it goes into checkpoints: a resumed run asks the same teacher the
same questions.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from plait.train.backends.base import Backend
from plait.types import Batch


class TeacherFailed(RuntimeError):
    """The teacher could not score a round (its process died or failed)."""


# Plain pickles over the socket: multiprocessing's own pickler (torch registers tensors with it)
# would hand tensors over as shared-memory handles, which a process not started by
# multiprocessing cannot open. A round's batch is a few MB.
def _send(conn: Connection, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


class Teacher(Protocol):
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, C] float32 log-probs of `batch`'s completion tokens under the teacher (CPU)."""

    def top_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """teacher.top_k: those log-probs, and the teacher's top_k likeliest tokens at each
        completion position, [B, C, k] ids and [B, C, k] float32 log-probs (CPU)."""

    def describe(self) -> str:
        """Where the teacher runs, for the run header."""

    def close(self) -> None: ...


class HeldTeacher:
    """The teacher the backend holds in this training process."""

    def __init__(self, cfg, backend: Backend):
        self.cfg, self.backend = cfg, backend

    def logprobs(self, batch: Batch) -> torch.Tensor:
        from plait.train.update import frozen_logprobs

        return frozen_logprobs(self.backend.teacher_model, batch, self.cfg, self.backend)

    def top_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from plait.train.update import frozen_logprobs

        return frozen_logprobs(self.backend.teacher_model, batch, self.cfg, self.backend, self.cfg.teacher.top_k)

    def describe(self) -> str:
        return f"{self.cfg.teacher.name_or_path}, held in every training process ({self.backend.name})"

    def close(self) -> None:
        pass


class ProcessTeacher:
    """The teacher in a child process of its own: it loads the model once, then answers one
    batch at a time (input ids, attention mask, prompt length) with its completion log-probs."""

    def __init__(self, cfg, device: torch.device):
        t = cfg.teacher
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        fd = theirs.detach()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "plait.train.teacher", str(fd)], pass_fds=(fd,), env=os.environ.copy()
        )
        os.close(fd)
        self.name = t.name_or_path
        # the run's own config: the child computes exactly as a held teacher would
        self._ask(dict(cfg=cfg, device=str(device), threads=torch.get_num_threads()))  # answers once loaded

    def _ask(self, message):
        try:
            _send(self.conn, message)
            answer = _recv(self.conn)
        except (EOFError, OSError) as err:
            code = self.process.wait(timeout=30)
            raise TeacherFailed(
                f"the teacher's process (pid {self.process.pid}, {self.name}) died (exit code {code}): "
                f"{type(err).__name__}"
            ) from None
        if isinstance(answer, str):  # its own error, with the traceback's last line
            raise TeacherFailed(f"the teacher's process failed: {answer}")
        return answer

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self._ask((batch.input_ids, batch.attention_mask, batch.completion_mask, batch.prompt_len, False))

    def top_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._ask((batch.input_ids, batch.attention_mask, batch.completion_mask, batch.prompt_len, True))

    def describe(self) -> str:
        return f"{self.name}, in its own process (pid {self.process.pid})"

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                _send(self.conn, None)
            except OSError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.conn.close()


class ServerTeacher:
    """The teacher served by `plait rollout-server --model TEACHER` (vLLM's prompt log-probs):
    each round's rows go to its replicas as token sequences, split evenly, and come back as the
    log-probs of their completion tokens."""

    def __init__(self, cfg):
        from plait.rollout.remote import RolloutServerError, ServerClient

        self.cfg, self.url = cfg, cfg.teacher.url.rstrip("/")
        start = "Start it with `plait rollout-server --model TEACHER CONFIG` and set teacher.url to its address"
        try:
            self.client = ServerClient(cfg.rollout.vllm, "the teacher's server")
            self.urls = self.client.discover([self.url], start)
            self.model = self.client.call("GET", self.url, "/health").get("model", "?")
        except RolloutServerError as e:
            raise TeacherFailed(str(e)) from None

    def _call(self, url: str, path: str, body: dict) -> dict:
        from plait.rollout.remote import RolloutServerError

        try:
            return self.client.call("POST", url, path, body)
        except RolloutServerError as e:
            raise TeacherFailed(str(e)) from None

    def _scores(self, batch: Batch, top_k: int) -> list[tuple[int, dict]]:
        """Each row's answer from the replica that scored it: (row, its part of the answer)."""
        from concurrent.futures import ThreadPoolExecutor

        real = batch.attention_mask.bool()
        sequences = [
            {"token_ids": batch.input_ids[i][real[i]].tolist(), "start": int(real[i, : batch.prompt_len].sum())}
            for i in range(len(batch))
        ]
        temperature = self.cfg.rollout.temperature or 1.0
        shares = [sequences[k :: len(self.urls)] for k in range(len(self.urls))]

        def ask(url: str, share: list[dict]) -> dict:
            return self._call(url, "/logprobs", {"sequences": share, "temperature": temperature, "top_k": top_k})

        with ThreadPoolExecutor(len(self.urls)) as pool:
            answers = list(pool.map(ask, self.urls, shares))
        keys = ("logprobs", "top_ids", "top_logprobs") if top_k else ("logprobs",)
        return [
            (k + j * len(self.urls), {key: answer[key][j] for key in keys})
            for k, answer in enumerate(answers)
            for j in range(len(answer["logprobs"]))
        ]

    def logprobs(self, batch: Batch) -> torch.Tensor:
        out = torch.zeros_like(batch.completion_mask, dtype=torch.float32)
        for i, row in self._scores(batch, 0):
            out[i, : len(row["logprobs"])] = torch.tensor(row["logprobs"])
        return out

    def top_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.cfg.teacher.top_k
        sampled = torch.zeros_like(batch.completion_mask, dtype=torch.float32)
        ids, values = torch.zeros(*sampled.shape, k, dtype=torch.long), torch.zeros(*sampled.shape, k)
        for i, row in self._scores(batch, k):
            n = len(row["logprobs"])
            sampled[i, :n] = torch.tensor(row["logprobs"])
            ids[i, :n], values[i, :n] = torch.tensor(row["top_ids"]), torch.tensor(row["top_logprobs"])
        return sampled, ids, values

    def describe(self) -> str:
        return f"{self.model}, on the server at {self.url} ({len(self.urls)} replica(s))"

    def close(self) -> None:
        self.client.close()


def make_teacher(cfg, backend: Backend) -> Teacher | None:
    """The run's teacher where `teacher.site` puts it (None: no teacher)."""
    if cfg.teacher is None:
        return None
    if cfg.teacher.site == "process":
        return ProcessTeacher(cfg, backend.device)
    if cfg.teacher.site == "server":
        return ServerTeacher(cfg)
    return HeldTeacher(cfg, backend)


# ---------------------------------------------------------------- the teacher's own process


def serve(conn: Connection) -> None:
    """Load the teacher the first message names, answer True, then answer each batch with its
    log-probs until None arrives (or the trainer goes away)."""
    from plait.models import load_model
    from plait.train.backends.local import LocalBackend
    from plait.train.update import frozen_logprobs

    spec = _recv(conn)
    cfg, t = spec["cfg"], spec["cfg"].teacher
    torch.set_num_threads(spec["threads"])
    try:
        model = load_model(t.name_or_path, t.dtype or cfg.model.dtype).to(spec["device"]).eval().requires_grad_(False)
    except Exception as err:  # noqa: BLE001 - the trainer reports it and stops
        _send(conn, f"loading {t.name_or_path}: {type(err).__name__}: {err}")
        return
    backend = LocalBackend.wrap(model, precision=cfg.train.precision)
    _send(conn, True)

    while True:
        try:
            message = _recv(conn)
        except EOFError:
            return
        if message is None:
            return
        input_ids, attention_mask, completion_mask, prompt_len, top = message
        batch = Batch(input_ids, attention_mask, completion_mask, torch.zeros(len(input_ids)), prompt_len)
        try:
            answer = frozen_logprobs(model, batch, cfg, backend, t.top_k if top else 0)
        except Exception as err:  # noqa: BLE001 - the trainer reports it and stops
            answer = f"{type(err).__name__}: {err}"
        _send(conn, answer)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
