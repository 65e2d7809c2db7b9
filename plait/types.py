"""The data contract between the stages of a GRPO step.

prompts -> rollout -> rewards -> advantages -> policy update. Every value that crosses a
stage boundary is one of these plain dataclasses, so each stage can be tested alone with
hand-made inputs.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable, ClassVar

import torch


@dataclass
class Prompt:
    """One dataset row, ready to generate from.

    `text` is the prompt after the chat template was applied; `token_ids` its tokens.
    `answer` is the reference answer (if the task has one) and `columns` every other dataset
    column, passed by name to reward functions.
    """

    index: int
    text: str
    token_ids: list[int]
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    # the prompt as the dataset gave it: a string, or a list of chat messages (conversational
    # data); reward functions get it as `prompts`, as TRL passes it (None: use `text`)
    source: Any = None
    # the chat messages `text` was rendered from (None: no chat template); multi-turn tool use
    # renders each tool turn after them
    messages: list[dict] | None = None
    # a trl_env row: what its environment's reset returned, rendered into the prompt; each
    # rollout's own reset must return the same
    env_observation: str | None = None


@dataclass
class SamplingParams:
    """How the rollout engine samples. temperature=0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    `logprobs[i]` is the log-probability the engine gave `token_ids[i]` under the
    temperature-scaled distribution (the same one the trainer computes), so the trainer can
    measure how far the engine's numbers are from its own.
    """

    prompt_index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    truncated: bool
    finish_reason: str  # "eos" | "stop" | "length"
    # rounds of updates applied to the weights that sampled it (engines with a copy of the
    # weights report it; None: sampled from the trainer's live weights)
    weight_version: int | None = None
    # with in-flight weight updates: the version of the weights that sampled each token
    token_versions: list[int] | None = None
    # multi-turn tool use: 1 where the model sampled the token, 0 where plait appended it (a
    # tool's output, the chat template's markup around it); only sampled tokens are trained on
    sampled_mask: list[int] | None = None
    # multi-turn: the conversation after the prompt, as chat messages (assistant and tool turns)
    messages: list[dict] | None = None
    # a trl_env rollout: what its environment's get_reward returned, or why it could not be had
    # (an infrastructure error: the completion is not scored)
    env_reward: float | None = None
    env_error: str | None = None
    # reward inputs of the program's own, given to the reward functions by name (a rollout_func's
    # extra keys, the columns an agent returns)
    columns: dict[str, Any] | None = None
    # the tokens it continues when they are not its group's prompt (an agent's own first call, a
    # rollout_func's own prompt_ids); None: the group's prompt
    prompt_ids: list[int] | None = None
    # numbers for the round's metrics, each named as the metric family it feeds (tools/calls,
    # agent/forks...: plait/train/metrics.py sums or averages them)
    info: dict[str, float] | None = None
    # multi-turn (tools, environments, an agent, a rollout_func with env_mask): only what the model
    # wrote, its turns with a line break where something else came between them; `text` also
    # holds what was added (a tool's output, an agent's question). None: all of `text` is the model's
    model_text: str | None = None

    def __setstate__(self, state: dict) -> None:
        """Rounds an asynchronous run's checkpoint holds (rollouts.pt) from before `info` and
        `columns`: their tool_stats/agent_stats become info, extra becomes columns."""
        tools, agent, extra = (state.pop(k, None) for k in ("tool_stats", "agent_stats", "extra"))
        if tools or agent:
            old = [("tools", tools or {}), ("agent", agent or {})]
            state["info"] = {f"{family}/{k}": v for family, stats in old for k, v in stats.items()}
        if extra:
            state["columns"] = extra
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}  # fields added since
        self.__dict__.update({**defaults, **state})

    @property
    def scored_text(self) -> str:
        """The text rewards read: the model's own words, never a tool's output or an agent's turn
        (a number either wrote would otherwise be taken for the model's answer)."""
        return self.text if self.model_text is None else self.model_text

    @property
    def staleness_versions(self) -> list[int]:
        """The weight version of each token (one entry when every token had the same)."""
        if self.token_versions:
            return self.token_versions
        return [] if self.weight_version is None else [self.weight_version]


@dataclass
class Group:
    """A prompt with its `num_generations` completions and their rewards.

    `rewards[f][j]` is reward function f's score for completion j (NaN-free by the time a
    Group exists; the reward runner checks). `total` is the weighted sum per completion.
    """

    prompt: Prompt
    completions: list[Completion]
    rewards: dict[str, list[float]] = field(default_factory=dict)
    total: list[float] = field(default_factory=list)


@dataclass
class Batch:
    """Tensors for one policy update, right-padded completions after left-padded prompts.

    input_ids, attention_mask: [B, T] with T = prompt_len + completion_len.
    completion_mask: [B, C] which completion positions are real tokens that count in the loss.
    advantages: [B] one scalar per completion, broadcast over its tokens, or [B, C] per token
        (REINFORCE++ with the KL in the reward).
    old_logprobs / ref_logprobs / sampling_logprobs / teacher_logprobs: [B, C] or None.
    teacher_top_ids / teacher_top_logprobs: [B, C, k] or None (completion fields too).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    prompt_len: int
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # the distillation teacher's, of the sampled tokens
    # teacher.top_k: the teacher's k likeliest tokens at each completion position [B, C, k], their log-probs
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    # which tensors run along the sequence [B, T], the completion [B, C] or one value per row [B]
    SEQUENCE_FIELDS: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")
    COMPLETION_FIELDS: ClassVar[tuple[str, ...]] = (
        "completion_mask",
        "old_logprobs",
        "ref_logprobs",
        "sampling_logprobs",
        "teacher_logprobs",
        "teacher_top_ids",
        "teacher_top_logprobs",
    )
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("advantages",)

    def map(
        self,
        seq: Callable[[torch.Tensor], torch.Tensor],
        completion: Callable[[torch.Tensor], torch.Tensor] | None = None,
        row: Callable[[torch.Tensor], torch.Tensor] | None = None,
        prompt_len: int | None = None,
    ) -> "Batch":
        """A new Batch with `seq` applied to the [B, T] tensors, `completion` to the [B, C] ones
        and `row` to the [B] ones (both default to `seq`). None tensors stay None; prompt_len is
        kept unless given."""
        fns = {
            **dict.fromkeys(self.SEQUENCE_FIELDS, seq),
            **dict.fromkeys(self.COMPLETION_FIELDS, completion or seq),
            **dict.fromkeys(self.ROW_FIELDS, row or seq),
        }
        tensors = {name: None if (t := getattr(self, name)) is None else fn(t) for name, fn in fns.items()}
        return replace(self, **tensors, prompt_len=self.prompt_len if prompt_len is None else prompt_len)

    def to(self, device) -> "Batch":
        """The same batch with every tensor on `device`."""
        return self.map(lambda t: t.to(device))

    def slice(self, start: int, stop: int) -> "Batch":
        """Rows [start, stop) as a new Batch (a micro-batch)."""
        return self.map(lambda t: t[start:stop])


def round_of(record: dict) -> int:
    """The round a metrics.jsonl / eval.jsonl / samples.jsonl record belongs to. Records name it
    `round`; runs written before that named it `step` (still written beside it, for one release)."""
    return int(record["round"] if "round" in record else record.get("step", 0))
