"""Prompt data: read rows (built-in task, JSONL, Parquet, a `datasets` folder), map fields,
apply the chat template, enforce the prompt-length limit, and serve them in a seeded order."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from plait.data.tasks import TASKS, task_examples, task_rows
from plait.programs.environments import SHOTS_COLUMN, SYSTEM_COLUMN, environment_rows
from plait.types import Prompt


__all__ = [
    "TASKS",
    "load_rows",
    "build_prompts",
    "describe_examples",
    "example_turns",
    "PromptOrder",
    "DataError",
    "source_problem",
    "data_problems",
    "data_warnings",
    "data_columns",
]


class DataError(ValueError):
    pass


def _infer_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise DataError(f"can't tell the format of '{path}': set data.format to jsonl, parquet or disk")


def source_problem(path: str | None, fmt: str) -> str | None:
    """Why a data path can't be read (checked at config time), or None."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return f"'{path}' does not exist"
    try:
        _infer_format(p, fmt)
    except DataError as err:
        return str(err)
    return None


def read_file(path: str, fmt: str = "auto", split: str = "train") -> list[dict]:
    """Rows from a JSONL file, a Parquet file, or a `datasets` folder saved with save_to_disk."""
    p = Path(path)
    kind = _infer_format(p, fmt)
    if kind == "jsonl":
        rows, bad = _scan_jsonl(p, math.inf)
        if bad:
            raise DataError(bad[0])
        return rows
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(p))
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"{path} has splits {list(ds)}, not '{split}': set data.split")
        ds = ds[split]
    return ds.to_list()


def _scan_jsonl(path: Path, limit: float) -> tuple[list[dict], list[str]]:
    """The first `limit` rows of a JSONL file (math.inf: all), and every bad line among them."""
    rows, bad = [], []
    for n, line in _text_lines(path):
        if len(rows) + len(bad) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            bad.append(f"{path}:{n}: not valid JSON ({err.msg}); each line must be one JSON object")
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
    return rows, bad


def _text_lines(path: Path):
    """(line number, text) of a UTF-8 file (a byte-order mark allowed), read line by line; a
    line that is not UTF-8 is named with its number and column."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{n}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                    "save the file as UTF-8"
                ) from None


def _first_rows(path: str, data_cfg, limit: int) -> tuple[list[dict], list[str]]:
    """The first `limit` rows of a data file and its bad lines among them (JSONL is scanned
    line by line; other formats are read whole). Raises what read_file raises."""
    if _infer_format(Path(path), data_cfg.format) == "jsonl":
        return _scan_jsonl(Path(path), limit)
    return read_file(path, data_cfg.format, data_cfg.split)[:limit], []


def data_problems(data_cfg, limit: int = 1000) -> list[str]:
    """What `plait check` finds in the data files without loading a model: unreadable or empty
    files, bad lines, rows without the prompt (or messages) field, malformed chat messages, in
    the first `limit` rows of each file."""
    if data_cfg.task is not None:
        return []
    out = []
    key = data_cfg.messages_field or data_cfg.prompt_field
    for name, path in (("data.path", data_cfg.path), ("data.eval_path", data_cfg.eval_path)):
        if path is None or source_problem(path, data_cfg.format):
            continue  # the config checks already said why
        try:
            rows, bad = _first_rows(path, data_cfg, limit)
        except (DataError, OSError, ValueError) as err:
            out.append(f"{name}: {err}")
            continue
        out += [f"{name}: {b}" for b in bad[:5]] + (
            [f"{name}: ... {len(bad) - 5} more bad lines"] if len(bad) > 5 else []
        )
        if not rows and not bad:
            out.append(f"{name}: '{path}' holds no rows")
        missing = [i for i, r in enumerate(rows) if key not in r]
        if missing:
            fields = sorted(rows[missing[0]])
            out.append(
                f"{name}: {len(missing)} of the first {len(rows)} rows have no field '{key}' (row {missing[0]} has "
                f"{fields}); set data.prompt_field or data.messages_field"
            )
        if data_cfg.messages_field:
            malformed = [i for i, r in enumerate(rows) if key in r and not _chat_messages(r[key])]
            if malformed:
                out.append(
                    f"{name}: row {malformed[0]}'s '{key}' is not a list of {{role, content}} messages "
                    f"({len(malformed)} such rows)"
                )
        else:
            bad_prompts = [(i, why) for i, r in enumerate(rows) if key in r and (why := prompt_problem(r[key], key))]
            if bad_prompts:
                i, why = bad_prompts[0]
                out.append(f"{name}: row {i}'s {why} ({len(bad_prompts)} such rows)")
        # a column named on purpose that no row has is a typo; the default one may be absent
        # from data without answers (data_warnings says so)
        answer = data_cfg.answer_field
        named = answer not in (None, type(data_cfg).model_fields["answer_field"].default)
        if rows and named and all(r.get(answer) is None for r in rows):
            out.append(f"{name}: {missing_answers(rows, answer)}")
    return out


def data_warnings(data_cfg, limit: int = 1000) -> list[str]:
    """What `plait check` says of the data that does not stop a run: rows that lack the answer
    field others have (rewards get answer=None for them), in the first `limit` rows of each file."""
    if data_cfg.task is not None or not data_cfg.answer_field:
        return []
    out = []
    for name, path in (("data.path", data_cfg.path), ("data.eval_path", data_cfg.eval_path)):
        if path is None or source_problem(path, data_cfg.format):
            continue
        try:
            rows = _first_rows(path, data_cfg, limit)[0]
        except (DataError, OSError, ValueError):
            continue  # data_problems names it
        note = missing_answers(rows, data_cfg.answer_field)
        if note:
            out.append(f"{name}: {note}")
    return out


def data_columns(data_cfg, limit: int = 1000) -> set[str] | None:
    """The columns rewards get from the training file's rows (every field but the prompt's, in
    the first `limit` rows), or None where the rows are not a file plait can read here (a built-in
    task; an unreadable file, which data_problems names)."""
    path = data_cfg.path
    if data_cfg.task is not None or path is None or source_problem(path, data_cfg.format):
        return None
    try:
        rows = _first_rows(path, data_cfg, limit)[0]
    except (DataError, OSError, ValueError):
        return None
    key = data_cfg.messages_field or data_cfg.prompt_field
    return {k for r in rows for k in r} - {key, SYSTEM_COLUMN, SHOTS_COLUMN}


def prompt_problem(value, key: str) -> str | None:
    """Why a prompt column's value is not a prompt's text (None: it is)."""
    if isinstance(value, str):
        return None if value.strip() else f"'{key}' is empty"
    if _chat_messages(value):
        return f"'{key}' holds chat messages, not text: set data.messages_field={key}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return None  # a number reads as its text
    return f"'{key}' is {type(value).__name__ if value is not None else 'null'}, not text"


def missing_answers(rows: list[dict], field: str) -> str | None:
    """A note when rows lack `field` or hold null there (None: every row holds it). Environments'
    rows may have no answers (their own scoring): only a file's rows are told that none has one."""
    missing = [i for i, r in enumerate(rows) if r.get(field) is None]
    if not missing:
        return None
    if len(missing) == len(rows):
        if any(r.get("environment") for r in rows):
            return None
        return (
            f"no row has an answer in '{field}' (row 0 has {sorted(rows[0])}): reward functions get answer=None "
            f"and accuracy scores 0; set data.answer_field to the column with the reference answers, or "
            f"data.answer_field=null for data without answers"
        )
    return (
        f"{len(missing)} of {len(rows)} rows have no '{field}' (first: row {missing[0]}): reward functions get "
        f"answer=None for them and must handle it (return None for 'not applicable')"
    )


def _chat_messages(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def load_rows(data_cfg, split: str, seed: int = 0, environments=None) -> list[dict]:
    """Rows for 'train' or 'eval' from the configured environments, task or files."""
    environments = [e for e in environments or [] if not e.ACTS_ON_ROWS]  # those act on the data's own rows
    if environments:
        rows = environment_rows(environments, split, seed, data_cfg.system_prompt)
        prompt, answer = data_cfg.prompt_field, data_cfg.answer_field or "answer"  # under the names the data says
        return [{prompt: r.pop("prompt"), answer: r.pop("answer"), **r} for r in rows]
    if data_cfg.task is not None:
        n = data_cfg.num_train if split == "train" else data_cfg.num_eval
        return task_rows(data_cfg.task, split, n, seed)
    path = data_cfg.path if split == "train" else data_cfg.eval_path
    if path is None:
        raise DataError("no evaluation data: set data.eval_path (or use a built-in data.task)")
    return read_file(path, data_cfg.format, data_cfg.split)


def _examples(data_cfg) -> list[dict]:
    """`data.examples` (null: the built-in task's own) as plain dicts."""
    examples = data_cfg.examples
    if examples is None:
        examples = task_examples(data_cfg.task) if data_cfg.task else []
    return [e if isinstance(e, dict) else e.model_dump() for e in examples]


def example_turns(data_cfg, tool_role: str = "tool") -> list[dict]:
    """The worked examples as earlier turns: the user asks, the assistant answers; an example
    with a tool call goes on as a tool run does, the tool's output in `tool_role`, then the
    assistant's answer after it."""
    turns = []
    for e in _examples(data_cfg):
        turns += [{"role": "user", "content": e["prompt"]}, {"role": "assistant", "content": e["completion"]}]
        if e.get("tool_output") is not None:
            turns += [{"role": tool_role, "content": e["tool_output"]}, {"role": "assistant", "content": e["answer"]}]
    return turns


def describe_examples(data_cfg) -> str | None:
    """The run header's line on the worked examples, if any."""
    n = len(_examples(data_cfg))
    if not n:
        return None
    own = f"task {data_cfg.task}'s own; data.examples: [] for none"
    whose = "data.examples" if data_cfg.examples is not None else own
    return f"few-shot: {n} worked example(s) before every prompt ({whose})"


def _after_system(messages: list[dict], turns: list[dict]) -> list[dict]:
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    return [*messages[:lead], *turns, *messages[lead:]]


def build_prompts(
    rows: list[dict],
    tokenizer,
    data_cfg,
    log=print,
    tools: list[dict] | None = None,
    envs=None,
    tool_role: str = "tool",
    split: str = "train",
) -> list[Prompt]:
    """Map fields, apply the chat template (describing `tools`, JSON schemas, to the model where
    the template can), and drop (or reject) prompts that are too long. With `envs` (trl_env
    entries, plait/programs/trl_env.py) each row's environment adds its reset observation to the
    prompt and describes its own tools. `tool_role`: the role of a worked example's tool output.
    `split` ("train" or "eval") only words the messages."""
    prompts, too_long, answered, longest = [], [], [], 0
    key = data_cfg.messages_field or data_cfg.prompt_field
    shots = example_turns(data_cfg, tool_role)
    asked = {t["content"] for t in shots if t["role"] == "user"}
    for i, row in enumerate(rows):
        if key not in row:
            raise DataError(
                f"row {i} has no field '{key}' (fields: {sorted(row)}); set data.prompt_field or data.messages_field"
            )
        if data_cfg.messages_field:
            messages = [dict(m) for m in row[key]]
        elif why := prompt_problem(row[key], key):
            raise DataError(f"row {i}'s {why}")
        else:
            messages = [{"role": "user", "content": str(row[key])}]
        system = data_cfg.system_prompt or row.get(SYSTEM_COLUMN)  # an environment's own, when unset
        if system and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system}, *messages]
        if shots:
            if any(m.get("role") == "user" and m.get("content") in asked for m in messages):
                answered.append(i)
            messages = _after_system(messages, shots)
        if row.get(SHOTS_COLUMN):  # an environment's own worked examples
            messages = _after_system(messages, row[SHOTS_COLUMN])
        conversational = data_cfg.conversational
        if conversational is None:
            conversational = data_cfg.messages_field is not None
        source = [dict(m) for m in messages] if conversational else str(row[key])
        # every other field is a column the rewards see (the answer also under its own name)
        columns = {k: v for k, v in row.items() if k not in (key, SYSTEM_COLUMN, SHOTS_COLUMN)}
        shown, observation = tools, None
        if envs is not None:
            try:
                messages, shown, columns, observation = envs.render(source, columns, messages, f"row {i}")
            except ValueError as err:
                raise DataError(str(err)) from None
        own = {"chat_template": data_cfg.chat_template} if isinstance(data_cfg.chat_template, str) else {}
        templated = bool(data_cfg.chat_template and (own or tokenizer.chat_template))
        if templated:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **({"tools": shown} if shown else {}), **own
            )
        else:
            text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > data_cfg.max_prompt_length:
            too_long.append(i)
            longest = max(longest, len(ids))
            continue
        answer = row.get(data_cfg.answer_field) if data_cfg.answer_field else None
        reference = None if answer is None else str(answer)
        prompts.append(Prompt(i, text, ids, reference, columns, source, messages if templated else None, observation))
    which = "held-out " if split == "eval" else ""
    fix = f"raise data.max_prompt_length (the longest is {longest} tokens)"
    if too_long:
        msg = (
            f"{len(too_long)} of {len(rows)} {which}prompts are longer than data.max_prompt_length="
            f"{data_cfg.max_prompt_length} tokens (first: row {too_long[0]})"
        )
        if data_cfg.overlong_prompts == "error":
            raise DataError(f"{msg}; {fix}, or set data.overlong_prompts=drop")
        lost = _environments_lost(rows, too_long)
        if lost:
            doing = "be evaluated" if split == "eval" else "train"
            raise DataError(
                f"{msg}: every prompt of environment(s) {', '.join(lost)} (worked examples and system prompt "
                f"included), so they would not {doing} at all; {fix}"
            )
        log(f"dropped {msg}; to keep them, {fix}")
    if answered:
        log(
            f"{len(answered)} of {len(rows)} prompts are also data.examples (first: row {answered[0]}): their answer "
            "is in the prompt"
        )
    note = missing_answers(rows, data_cfg.answer_field) if data_cfg.answer_field else None
    if note:
        log(note)
    if not prompts:
        left = "no held-out prompts left to evaluate on" if split == "eval" else "no prompts left to train on"
        raise DataError(left + (f": all {len(rows)} were too long; {fix}" if too_long else ""))
    return prompts


def environment_prompt_problems(cfg) -> list[str]:
    """`plait check`: environments whose every prompt (worked examples and system prompt
    included) is longer than data.max_prompt_length, found with the model's tokenizer where it
    is on disk, as the run would find them when it starts. Only for environments that make their
    own problems and no tools (whose descriptions lengthen prompts): the run checks the rest."""
    from plait.models import load_tokenizer, local_model_folder

    envs = cfg.environments or []
    folder = local_model_folder(cfg.model.name_or_path)  # None: the run names the problem, or converts it first
    if not envs or folder is None or cfg.rollout.tools is not None or any(s.ACTS_ON_ROWS for s in envs):
        return []
    tokenizer = load_tokenizer(str(folder))
    evaluating = cfg.eval.before or cfg.eval.after or cfg.eval.every_steps
    out = []
    for split in ["train", "eval"] if evaluating else ["train"]:
        try:
            rows = load_rows(cfg.data, split, cfg.seed, envs)
            build_prompts(rows, tokenizer, cfg.data, log=lambda *_: None, split=split)
        except DataError as err:
            out.append(str(err))
    return out


def _environments_lost(rows: list[dict], dropped: list[int]) -> list[str]:
    """The environments whose every row was dropped."""
    labels = {r.get("environment") for r in rows} - {None}
    gone = set(dropped)
    kept = {r.get("environment") for i, r in enumerate(rows) if i not in gone}
    return sorted(labels - kept)


@dataclass
class PromptOrder:
    """Which prompts each step uses: a seeded permutation per epoch, read sequentially.

    With several training processes, process `rank` of `stride` reads every stride-th
    position (rank, rank + stride, ...): together they read the same prompts, in the same
    epochs, as one process would, and none needs to ask another how many it used (dynamic
    sampling takes a different number per process). `consumed` counts this process's
    prompts, so resuming only needs that number.
    """

    size: int
    seed: int
    shuffle: bool = True
    consumed: int = 0
    rank: int = 0
    stride: int = 1
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._cache:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._cache = {epoch: order}
        return self._cache[epoch]

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.consumed * self.stride + self.rank, self.size)
            out.append(self._perm(epoch)[pos])
            self.consumed += 1
        return out
