"""Coming from Open-R1 / TRL, tried as a new user would: a folder of Open-R1-style reward
functions (conversational completions, the `solution` column, math-verify with its default
signal-based timeouts) and a chat-message JSONL train with `plait train`, with no `task: null`;
and an Open-R1-shaped recipe trains with `plait train --trl-config`."""

import json
import os
import subprocess
import sys

import yaml
from open_r1_rewards import ACCURACY_REWARD


REWARDS = (
    ACCURACY_REWARD
    + '''
import json
import os
import threading


def _record(**fields):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps(fields) + "\\n")


def accuracy_reward(completions, solution, **kwargs):
    """Open-R1's accuracy reward, unchanged, and a record of how it was called."""
    rewards = open_r1_accuracy(completions, solution, **kwargs)
    _record(
        completion=type(completions[0]).__name__,
        role=completions[0][0]["role"],
        prompt=kwargs["prompts"][0],
        main_thread=threading.current_thread() is threading.main_thread(),
        pid=os.getpid(),
        step=kwargs["trainer_state"].global_step,
    )
    return rewards


def length_reward(completions, **kwargs):
    """A shaping reward so the tiny random model's groups differ."""
    return [len(c[0]["content"]) / 100 for c in completions]
'''
)


def _tiny(model):
    return {
        "model": {"name_or_path": str(model)},
        "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 12},
        "train": {"micro_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3, "precision": "fp32"},
        "eval": {"before": False, "after": False},
        "log": {"console": "plain"},
    }


def _rows(n=8):
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Put the answer in \\boxed{{}}."}],
            "solution": f"${2 * i}$",
        }
        for i in range(n)
    ]


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _plait(args, cwd, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONPATH", None)  # like a new user: only the current directory holds their rewards
    return subprocess.run(
        [sys.executable, "-m", "plait.cli", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=900
    )


def test_open_r1_reward_folder_and_chat_jsonl_train_unchanged(tiny_model_path, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    cfg = _tiny(tiny_model_path)
    cfg["data"] = {"path": "train.jsonl", "messages_field": "prompt", "system_prompt": "Think, then answer."}
    cfg["rewards"] = [{"name": "my_rewards:accuracy_reward"}, {"name": "my_rewards:length_reward", "weight": 0.1}]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    seen = tmp_path / "seen.jsonl"
    proc = _plait(["train", "config.yaml", "--output-dir", "run"], tmp_path, {"SEEN_FILE": str(seen)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("reward/my_rewards:accuracy_reward/mean" in m and "entropy" in m for m in metrics)
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [c["step"] for c in calls] == [0, 1]  # trainer_state: rounds done before each
    for c in calls:
        assert c["completion"] == "list" and c["role"] == "assistant"  # completion[0]["content"] works
        assert c["main_thread"]  # a main thread: that of the reward's own process (the trainer's is busy)
        assert c["prompt"][0] == {"role": "system", "content": "Think, then answer."}  # the prompt as the model saw it
    assert len({c["pid"] for c in calls}) == 1  # one process for the run, not one per call
    assert "train.jsonl" in (tmp_path / "run" / "config.yaml").read_text()


def test_an_open_r1_recipe_converts_and_trains(tiny_model_path, tmp_path):
    rows = [{"problem": r["prompt"][0]["content"], "solution": r["solution"]} for r in _rows()]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        # shaped like Open-R1's recipes/*/grpo/config_demo.yaml
        "model_name_or_path": str(tiny_model_path),
        "model_revision": "main",
        "torch_dtype": "float32",
        "attn_implementation": "sdpa",
        "dataset_name": "math.jsonl",
        "dataset_prompt_column": "problem",
        "system_prompt": "You first think, then answer. Respond as <think>\n...\n</think>\n<answer>\n...\n</answer>",
        "bf16": False,
        "use_vllm": False,
        "do_eval": False,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": False,
        "hub_model_id": "tiny-GRPO",
        "learning_rate": 1.0e-03,
        "log_completions": True,
        "logging_steps": 1,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "max_prompt_length": 256,
        "max_completion_length": 12,
        "max_steps": -1,
        "num_generations": 4,
        "num_train_epochs": 1,
        "output_dir": "run",
        "per_device_train_batch_size": 4,
        "push_to_hub": False,
        "report_to": ["none"],
        "reward_funcs": ["accuracy", "format", "tag_count", "repetition_penalty"],
        "reward_weights": [1.0, 1.0, 1.0, 0.5],
        "beta": 0.04,
        "loss_type": "grpo",
        "save_strategy": "epoch",
        "save_total_limit": 1,
        "seed": 42,
        "warmup_ratio": 0.25,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    conv = _plait(["convert-config", "recipe.yaml", "-o", "plait.yaml"], tmp_path)
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert "NOT carried over" not in conv.stderr  # everything in this recipe has a plait meaning
    proc = _plait(["train", "--trl-config", "recipe.yaml"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    used = yaml.safe_load((run / "config.yaml").read_text())
    # 4 completions x 1 process x 2 accumulation / 4 generations = 2 prompts a round; 8 rows = 4 rounds
    assert used["rollout"]["prompts_per_step"] == 2 and used["train"]["max_steps"] == 4
    assert used["train"]["warmup_steps"] == 1 and used["train"]["min_lr_ratio"] == 0.1
    assert used["algo"]["beta"] == 0.04 and used["algo"]["loss_type"] == "grpo"
    assert used["data"]["conversational"] is True and used["data"]["answer_field"] == "solution"
    assert [r["name"] for r in used["rewards"]] == ["accuracy", "think_format", "tag_count", "repetition_penalty"]
    converted = _flat(yaml.safe_load((tmp_path / "plait.yaml").read_text()))
    rewards = converted.pop("rewards")
    assert {k: _flat(used).get(k) for k in converted} == converted  # what convert-config wrote is what ran
    assert [{k: r[k] for k in spec} for r, spec in zip(used["rewards"], rewards)] == rewards
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all("kl" in m for m in metrics)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]  # keep_last 1
    assert (run / "final" / "model.safetensors").is_file()
