"""A tiny model that has learned to call the Python tool: for tests of multi-turn rollouts.

A random tiny model never writes a ```python block, so nothing multi-turn would happen. This
fine-tunes one (a few hundred steps of plain supervised learning, seconds on a CPU) on
conversations of the built-in `multiply` task in the chat template: the assistant writes a
python block, the tool prints the product, the assistant answers in \\boxed{}. Sampled at
temperature 1 it calls the tool most of the time, with code (and numbers) of its own.
"""

from __future__ import annotations

from pathlib import Path


CALL = "Let me compute it.\n```python\nprint({a} * {b})\n```\n"
ANSWER = "The answer is \\boxed{{{product}}}."


def conversation(row: dict) -> list[dict]:
    q = row["prompt"]
    return [
        {"role": "user", "content": q},
        {"role": "assistant", "content": CALL.format(**row)},
        {"role": "tool", "content": f"{row['a'] * row['b']}\n"},
        {"role": "assistant", "content": ANSWER.format(product=row["a"] * row["b"])},
    ]


def teach_tool_calls(
    path: str | Path, out: str | Path, steps: int = 120, rows: int = 64, batch: int = 8, seed: int = 0
) -> Path:
    """Fine-tune the model at `path` to call the tool; save it to `out`."""
    from plait.data.tasks import multiply

    return teach(path, out, [conversation(row) for row in multiply("train", rows, seed)], steps, batch, seed)


def teach(
    path: str | Path, out: str | Path, conversations: list[list[dict]], steps: int, batch: int, seed: int = 0, lr=3e-3
) -> Path:
    """Fine-tune the model at `path` on the assistant turns of `conversations` (chat messages,
    the first one the user's); save it to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.train.hostmem import retained_host_memory

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    seqs = []
    for conv in conversations:
        prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False)
        whole = tok.apply_chat_template(conv, tokenize=False)
        ids = tok(whole, add_special_tokens=False)["input_ids"]
        labels = list(ids)
        labels[: len(tok(prompt, add_special_tokens=False)["input_ids"])] = [-100] * len(
            tok(prompt, add_special_tokens=False)["input_ids"]
        )
        seqs.append((ids, labels))
    width = max(len(i) for i, _ in seqs)
    ids = torch.tensor([i + [tok.pad_token_id or 0] * (width - len(i)) for i, _ in seqs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in seqs])
    mask = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in seqs])[:, None]).long()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    # as a training run does: each step's logits over the vocabulary (~100 MB) are served from
    # memory the last step freed, not page-faulted in again (8 s of a 40-step teach in the kernel,
    # 0.9 s with it; the same weights)
    with retained_host_memory():
        for _ in range(steps):
            pick = torch.randint(0, len(seqs), (batch,))
            hidden = model.model(input_ids=ids[pick], attention_mask=mask[pick]).last_hidden_state[:, :-1]
            target = labels[pick][:, 1:]
            taught = target != -100  # the vocabulary projection only where there is a label: most of the cost
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[taught]), target[taught])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)


def made_once(tmp_path_factory, name: str, make) -> Path:
    """`make(folder)` run once for the whole test session, however many pytest-xdist workers
    ask: the first makes it under a file lock in the folder the workers share, the others wait
    and take it. A taught model costs about a minute of CPU; unshared, each worker that ran one
    of its tests made its own (the same bits: the same seed and thread count)."""
    import os

    from filelock import FileLock

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name) / "model")
    root = tmp_path_factory.getbasetemp().parent  # pytest-of-USER/pytest-N: every worker's basetemp is under it
    folder, done = root / name / "model", root / name / "DONE"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            make(folder)
            done.touch()
    return folder
