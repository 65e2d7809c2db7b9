"""Two small tasks of our own, trained from JSONL files with our own reward functions, for
measuring whether runs hold their peak (docs/reproducibility.md, "Runs that hold their peak").

    python bench/collapse_tasks.py OUT_DIR     # writes OUT_DIR/{multiply,larger}/{train,eval}.jsonl
                                               # and OUT_DIR/{multiply,larger}.yaml
    plait train OUT_DIR/multiply.yaml --seeds 0-4 --output-dir runs/multiply

- multiply: "What is 7 times 23?" (a one-digit by a two-digit number); the reward pays 1 when the
  last number of the completion is the product. Beyond the bundled model at first (a few percent
  right), within reach of RL.
- larger: "Which is larger, 47 or 74?"; the reward pays 1 when the last number is the larger.
  Half right by guessing: a run can settle on "always the first" or "always the second", the
  answer-position collapse.

Both use the demo's settings otherwise (8 prompts x 8 completions, dapo, lr 3e-5, fp32) for 15
rounds, evaluate greedily every 5 rounds on 100 held-out prompts and keep the best model.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path


def last_number_is_answer(completions, answer, **kwargs):
    """1.0 when the completion's last number is the answer, else 0.0."""
    out = []
    for text, want in zip(completions, answer):
        found = re.findall(r"-?\d+", text)
        out.append(1.0 if found and found[-1] == str(want) else 0.0)
    return out


def multiply(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(3, 9), rng.randint(11, 39)
        rows.append({"question": f"What is {a} times {b}?", "answer": str(a * b)})
    return rows


def larger(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.sample(range(10, 100), 2)
        rows.append({"question": f"Which is larger, {a} or {b}?", "answer": str(max(a, b))})
    return rows


EXAMPLES = {
    "multiply": [("What is 2 times 41?", "2 times 41 is 82."), ("What is 10 times 12?", "10 times 12 is 120.")],
    "larger": [
        ("Which is larger, 3 or 8?", "The larger is 8."),
        ("Which is larger, 105 or 101?", "The larger is 105."),
    ],
}

CONFIG = """\
# bench/collapse_tasks.py: a task of our own from JSONL files with our own reward
name: {name}
model: {{name_or_path: smollm2-135m-instruct}}
data:
  path: {dir}/train.jsonl
  eval_path: {dir}/eval.jsonl
  prompt_field: question
  answer_field: answer
  examples: {examples}
rollout: {{prompts_per_step: 8, num_generations: 8, max_completion_length: 24, temperature: 1.0}}
rewards:
  - {{name: "{rewards}:last_number_is_answer"}}
algo: {{loss_type: dapo}}
train: {{max_steps: 15, learning_rate: 3.0e-5, precision: fp32}}
eval: {{every_steps: 5, metric: "{rewards}:last_number_is_answer"}}
checkpoint: {{keep_best: true}}
"""


def main(out: Path) -> None:
    for name, make in (("multiply", multiply), ("larger", larger)):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        rng = random.Random(name)
        for split, n in (("train", 1000), ("eval", 100)):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make(rng, n)))
        examples = json.dumps([{"prompt": p, "completion": c} for p, c in EXAMPLES[name]])
        rewards = Path(__file__).resolve()
        (out / f"{name}.yaml").write_text(
            CONFIG.format(name=name, dir=folder.resolve(), examples=examples, rewards=rewards)
        )
        print(out / f"{name}.yaml")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/collapse-tasks"))
