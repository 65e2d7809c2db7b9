"""Model-based reward: score prompt + completion with a local sequence-classification reward model."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from plait.models import pad_id_of, text_config
from plait.rewards._checks import require_int, require_number


# (resolved folder, device) -> (model, tokenizer, pad id, lock serialising its use)
_CACHE: dict[tuple[str, str], tuple[Any, Any, int, threading.Lock]] = {}
_CACHE_LOCK = threading.Lock()


def _load(path: Path, device: str):
    """The reward model and tokenizer for (path, device), loaded once per process."""
    key = (str(path.resolve()), device)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path)
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward_model: {path} has num_labels={model.config.num_labels}; a reward model has a single "
                "output logit (num_labels=1)"
            )
        # The model finds each row's last token by looking for the pad id, so batching needs one.
        text = text_config(model.config)
        pad_id = text.pad_token_id
        if pad_id is None:
            pad_id = pad_id_of(tokenizer)
            if pad_id is None:
                raise ValueError(f"reward_model: neither {path}'s config nor its tokenizer defines a pad or eos token")
            text.pad_token_id = pad_id
        model.to(device).eval()
        _CACHE[key] = (model, tokenizer, int(pad_id), threading.Lock())
        return _CACHE[key]


def _messages(prompt, completion) -> list[dict]:
    """A user/assistant conversation from a prompt (string or messages) and a completion."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if isinstance(completion, list):
        return messages + list(completion)
    return messages + [{"role": "assistant", "content": str(completion)}]


def _token_ids(tokenizer, prompt, completion) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(_messages(prompt, completion), tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt_text = "\n".join(m["content"] for m in prompt) if isinstance(prompt, list) else str(prompt)
    completion_text = "".join(m["content"] for m in completion) if isinstance(completion, list) else str(completion)
    return tokenizer(prompt_text + completion_text)["input_ids"]


def reward_model(
    completions: list,
    prompts: list | None = None,
    path: str | None = None,
    batch_size: int = 8,
    max_length: int = 1024,
    device: str = "cpu",
    scale: float = 1.0,
    **_,
) -> list[float]:
    """Score from a local Hugging Face reward model (a sequence classifier with one logit, as
    trained by the Bradley-Terry objective of Ouyang et al. 2022, "Training language models to
    follow instructions with human feedback", arXiv:2203.02155; TRL's RewardTrainer writes these):

        r_i = scale * RM(prompt_i + completion_i)[label 0]

    The input is the prompt followed by the completion: through the reward model tokenizer's
    chat template as a user/assistant conversation when it has one (a prompt given as a list of
    messages is used as is), else the two strings concatenated. Inputs longer than `max_length`
    tokens keep their last `max_length` (the model reads its score at the final token).

    kwargs: `path` a local model folder (required), `batch_size` >= 1, `max_length` >= 1,
    `device` (a torch device string), `scale` a finite number. The model is loaded once per
    (path, device) and kept for the life of the process.
    """
    if path is None:
        raise ValueError("reward_model: path is required: set kwargs.path to a local reward model folder")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"reward_model: path must be a local model folder (config.json + weights + tokenizer); {str(path)!r} "
            + ("is not a folder" if folder.exists() else "does not exist")
        )
    require_int("reward_model", "batch_size", batch_size)
    require_int("reward_model", "max_length", max_length)
    require_number("reward_model", "scale", scale)
    import torch

    try:
        device = str(torch.device(device))
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"reward_model: device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from err
    if prompts is None or len(prompts) != len(completions):
        raise ValueError(
            f"reward_model: needs one prompt per completion, got {'no prompts' if prompts is None else len(prompts)} "
            f"for {len(completions)} completions"
        )
    if not completions:
        return []

    model, tokenizer, pad_id, lock = _load(folder, device)
    with lock:  # a fast tokenizer and a shared model are not safe to drive from several threads
        ids = []
        for prompt, completion in zip(prompts, completions):
            tokens = _token_ids(tokenizer, prompt, completion)[-max_length:]
            ids.append(tokens or [pad_id])
        scores = [0.0] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths together: less padding
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                width = max(len(ids[i]) for i in chunk)
                # Right padding: real tokens keep positions 0..n-1 exactly as when scored alone,
                # and the model reads the score at each row's last non-pad token.
                input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
                attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, i in enumerate(chunk):
                    input_ids[row, : len(ids[i])] = torch.tensor(ids[i])
                    attention_mask[row, : len(ids[i])] = 1
                logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
                for row, value in zip(chunk, logits[:, 0].float().cpu().tolist()):
                    scores[row] = value * scale
    return scores
