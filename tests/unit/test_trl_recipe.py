"""TRL / Open-R1 recipes as plait configs: every mapping the converter makes, the batch and
step arithmetic, and every key it can't carry over is listed with a reason."""

import ast
import json
import math
import re
import textwrap
from types import SimpleNamespace

import pytest
import torch

from plait.algo.losses import engine_log_ratio, engine_mismatch_weights
from plait.cli import main
from plait.config.load import config_from_dict
from plait.config.trl import convert_recipe, describe


# Open-R1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml, as published (TRL 0.18 era)
OPEN_R1_DEMO = {
    "model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct",
    "model_revision": "main",
    "torch_dtype": "bfloat16",
    "attn_implementation": "flash_attention_2",
    "dataset_name": "open-r1/OpenR1-Math-220k",
    "dataset_prompt_column": "problem",
    "system_prompt": "Respond in the following format: <think>\n...\n</think>\n<answer>\n...\n</answer>",
    "bf16": True,
    "use_vllm": True,
    "do_eval": False,
    "gradient_accumulation_steps": 4,
    "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "hub_model_id": "Qwen2.5-1.5B-Open-R1-GRPO",
    "learning_rate": 2.0e-05,
    "log_completions": True,
    "logging_steps": 1,
    "lr_scheduler_type": "cosine_with_min_lr",
    "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
    "max_prompt_length": 512,
    "max_completion_length": 1024,
    "max_steps": -1,
    "num_generations": 16,
    "num_train_epochs": 1,
    "output_dir": "data/Qwen2.5-1.5B-Open-R1-GRPO",
    "per_device_train_batch_size": 16,
    "push_to_hub": True,
    "report_to": ["wandb"],
    "reward_funcs": ["accuracy", "format", "tag_count", "cosine", "code"],
    "reward_weights": [1.0, 1.0, 1.0, 0.5, 1.0],
    "cosine_max_len": 800,
    "save_strategy": "epoch",
    "save_total_limit": 1,
    "seed": 42,
    "warmup_ratio": 0.1,
}


def test_an_open_r1_recipe_maps_key_by_key():
    conv = convert_recipe(OPEN_R1_DEMO, processes=8, dataset_rows=10_000)
    c = conv.config
    assert c["model"] == {
        "name_or_path": "Qwen/Qwen2.5-1.5B-Instruct",
        "dtype": "bfloat16",
        "gradient_checkpointing": True,
    }
    assert c["data"]["path"] == "open-r1/OpenR1-Math-220k" and c["data"]["task"] is None
    assert c["data"]["prompt_field"] == "problem" and c["data"]["conversational"] is True
    assert c["data"]["answer_field"] == "solution"  # Open-R1's accuracy reads `solution`
    assert c["data"]["system_prompt"].startswith("Respond in the following format")
    # 16 completions x 8 processes x 4 accumulation = 512 per optimizer step = 32 prompts x 16
    assert c["rollout"]["prompts_per_step"] == 32 and c["rollout"]["num_generations"] == 16
    assert c["train"]["micro_batch_size"] == 16 and c["train"]["gradient_accumulation_steps"] == 4
    # one epoch of 10000 rows at 32 prompts a round; warmup 10% of those optimizer steps
    assert c["train"]["max_steps"] == 313 and c["train"]["warmup_steps"] == 32
    assert c["train"]["lr_scheduler"] == "cosine" and c["train"]["min_lr_ratio"] == 0.1
    assert c["train"]["learning_rate"] == 2e-5 and c["train"]["precision"] == "bf16"
    assert c["train"]["lr_by_signal"] is False  # TRL's rate is every update's
    assert c["checkpoint"] == {"save_steps": 312, "keep_last": 1}
    assert c["rollout"]["engine"] == "vllm" and c["rollout"]["vllm"]["mode"] == "colocate"
    assert c["seed"] == 42 and c["eval"] == {"before": False, "after": False}
    assert c["rewards"] == [
        {"name": "accuracy", "weight": 1.0},
        {"name": "think_format", "weight": 1.0},
        {"name": "tag_count", "weight": 1.0},
        {
            "name": "cosine_length",
            "weight": 0.5,
            # Open-R1's defaults, not plait's, where the recipe says nothing
            "kwargs": {
                "min_value_wrong": 0.0,
                "max_value_wrong": -0.5,
                "min_value_correct": 0.5,
                "max_value_correct": 1.0,
                "max_length": 800,
            },
        },
    ]
    # TRL's current defaults fill what the recipe leaves out
    assert c["algo"]["loss_type"] == "dapo" and c["algo"]["beta"] == 0.0 and c["algo"]["scale_rewards"] == "group"
    unmapped = {k: why for k, _, why in conv.unmapped}
    assert "reward_funcs: code" in unmapped and "tests" in unmapped["reward_funcs: code"]
    ignored = {k for k, _, _ in conv.ignored}
    assert {"hub_model_id", "push_to_hub", "logging_steps", "attn_implementation", "report_to"} <= ignored
    # every recipe key is mapped, ignored or listed
    listed = set(unmapped) | ignored
    mapped_somewhere = set(OPEN_R1_DEMO) - listed
    assert "max_prompt_length" in mapped_somewhere and "cosine_max_len" in mapped_somewhere
    config_from_dict(c)  # a valid plait config
    text = describe(conv)
    assert "NOT carried over (1)" in text and "reward_funcs: code" in text


def test_trl_018_defaults_for_open_r1_recipes():
    recipe = {"model_name_or_path": "m", "dataset_name": "d", "max_steps": 10}
    current = convert_recipe(recipe).config
    old = convert_recipe(recipe, defaults="0.18").config
    assert (current["algo"]["beta"], current["algo"]["loss_type"]) == (0.0, "dapo")
    assert (old["algo"]["beta"], old["algo"]["loss_type"]) == (0.04, "bnpo")
    assert old["rollout"]["max_completion_length"] == 256 and current["rollout"]["max_completion_length"] == 512
    assert current["train"]["learning_rate"] == 1e-6  # TRL's, not plait's 3e-5


def test_cispo_epsilon_high_becomes_the_cap_itself():
    conv = convert_recipe({"loss_type": "cispo", "epsilon_high": 5.0, "max_steps": 4})
    assert conv.config["algo"]["cispo_cap"] == 5.0 and "epsilon_high" not in conv.config["algo"]
    # TRL without epsilon_high caps at epsilon (0.2): carried over as it is, and said
    conv = convert_recipe({"loss_type": "cispo", "max_steps": 4})
    assert conv.config["algo"]["cispo_cap"] == 0.2 and any("cispo_cap=0.2" in n for n in conv.notes)
    conv = convert_recipe({"loss_type": "dapo", "epsilon_high": 0.28, "max_steps": 4})
    assert conv.config["algo"]["epsilon_high"] == 0.28


def test_loss_options_and_their_trl_names():
    conv = convert_recipe(
        {
            "max_steps": 4,
            "beta": 0.02,
            "use_bias_correction_kl": True,
            "top_entropy_quantile": 0.2,
            "scale_rewards": False,
            "delta": 1.5,
            "importance_sampling_level": "sequence",
            "mask_truncated_completions": True,
            "sync_ref_model": True,
            "ref_model_sync_steps": 64,
            "multi_objective_aggregation": "normalize_then_sum",
            "loss_type": "sapo",
        }
    )
    a = conv.config["algo"]
    assert a["kl_bias_correction"] is True and a["top_entropy_quantile"] == 0.2 and a["scale_rewards"] == "none"
    assert a["delta"] == 1.5 and a["importance_sampling_level"] == "sequence" and a["mask_truncated_completions"]
    assert a["ref_model_sync_steps"] == 64 and a["ref_model_mixup_alpha"] == 0.6
    assert a["reward_aggregation"] == "normalize_then_sum"
    assert [k for k, _, _ in conv.unmapped] == ["loss_type"]  # sapo has no plait equivalent


def test_steps_count_optimizer_steps_in_trl_and_rounds_in_plait():
    conv = convert_recipe(
        {
            "max_steps": 100,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "steps_per_generation": 4,  # micro-steps: one round feeds 2 optimizer steps
            "num_iterations": 2,
            "num_generations": 4,
            "save_steps": 20,
            "warmup_steps": 3,
        }
    )
    c = conv.config
    assert c["rollout"]["prompts_per_step"] == 2 and c["algo"]["steps_per_generation"] == 2
    assert c["algo"]["num_iterations"] == 2
    assert c["train"]["max_steps"] == 25  # 100 optimizer steps / (2 updates x 2 passes)
    assert c["checkpoint"]["save_steps"] == 5 and c["train"]["warmup_steps"] == 3
    config_from_dict(c)


def test_what_cannot_be_derived_is_listed_not_guessed():
    conv = convert_recipe({"num_train_epochs": 2, "warmup_ratio": 0.1, "save_strategy": "epoch", "min_p": 0.1})
    unmapped = {k for k, _, _ in conv.unmapped}
    assert {"num_train_epochs", "warmup_ratio", "save_strategy", "min_p"} <= unmapped
    assert "max_steps" not in conv.config.get("train", {})
    conv = convert_recipe({"max_steps": 2, "my_own_key": 1, "vllm_device": "auto"})
    reasons = {k: why for k, _, why in conv.unmapped}
    assert reasons["my_own_key"] == "not a GRPO recipe key plait knows" and "vllm_device" in reasons


def test_server_mode_and_lora():
    conv = convert_recipe(
        {
            "max_steps": 2,
            "use_vllm": True,
            "vllm_mode": "server",
            "vllm_server_port": 8123,
            "vllm_importance_sampling_cap": 3.0,
            "use_peft": True,
            "lora_r": 8,
            "lora_target_modules": ["q_proj", "v_proj"],
        }
    )
    c = conv.config
    assert c["rollout"]["vllm"] == {"mode": "server", "servers": ["http://localhost:8123"]}
    assert c["algo"]["engine_is_correction"] is True and c["algo"]["engine_is_cap"] == 3.0
    assert c["model"]["lora"] == {"r": 8, "alpha": 32, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


def test_convert_config_command(tmp_path, capsys):
    import yaml

    rows = [{"problem": f"What is {i} + 1?", "solution": f"${i + 1}$"} for i in range(10)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": "some/model",
                "dataset_name": str(data),
                "dataset_prompt_column": "problem",
                "num_train_epochs": 1,
                "per_device_train_batch_size": 4,
                "num_generations": 2,
                "warmup_ratio": 0.2,
                "save_strategy": "epoch",
                "hub_model_id": "x",
            }
        )
    )
    assert main(["convert-config", str(recipe), "-o", str(tmp_path / "plait.yaml")]) == 0
    err = capsys.readouterr().err
    assert "ignored (no effect in plait): hub_model_id" in err and "NOT carried over" not in err
    out = yaml.safe_load((tmp_path / "plait.yaml").read_text())
    # the rows were counted: 10 rows / 2 prompts a round = 5 rounds; warmup 20% = 1; save each epoch
    assert out["train"]["max_steps"] == 5 and out["train"]["warmup_steps"] == 1
    assert out["checkpoint"]["save_steps"] == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1e-6\n")
    assert main(["convert-config", str(bad)]) == 2
    assert f"{bad}:2:1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [[], ["--trl-defaults", "0.18"]])
def test_check_reads_a_recipe(tmp_path, capsys, tiny_model_path, flag):
    import yaml

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1", "solution": str(i + 1)}) + "\n" for i in range(6)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(tiny_model_path),
                "dataset_name": str(data),
                "dataset_prompt_column": "problem",
                "max_steps": 3,
                "per_device_train_batch_size": 4,
                "num_generations": 4,
                "reward_funcs": ["accuracy", "format"],
            }
        )
    )
    assert main(["check", "--trl-config", str(recipe), *flag]) == 0
    captured = capsys.readouterr()
    assert "ok: 1 training process(es); 1 prompts x 4 generations" in captured.out
    assert "as a plait config" in captured.err


def test_an_rloo_recipe_converts_with_rloos_defaults_and_advantages():
    conv = convert_recipe({"max_steps": 4, "normalize_advantages": True, "reward_clip_range": [-1, 1]}, trainer="rloo")
    c = conv.config
    a = c["algo"]
    assert a["advantage_estimator"] == "rloo" and a["scale_rewards"] == "batch"  # normalize_advantages
    # RLOOConfig's beta 0.05 goes into the reward as k1, as RLOOTrainer does
    assert (a["beta"], a["kl_in_reward"], a["kl_estimator"]) == (0.05, True, "k1")
    assert c["rollout"]["num_generations"] == 2  # RLOOConfig's default, not GRPOConfig's 8
    assert a["loss_type"] == "dr_grpo" and any("RLOO's loss clips one ratio per completion" in n for n in conv.notes)
    assert [k for k, _, _ in conv.unmapped] == ["reward_clip_range"]
    config_from_dict(c)
    plain = convert_recipe({"max_steps": 4, "beta": 0.0}, trainer="rloo").config["algo"]
    assert plain["scale_rewards"] == "none" and "kl_in_reward" not in plain
    with pytest.raises(ValueError, match="trainer"):
        convert_recipe({"max_steps": 4}, trainer="ppo")


def _trl_engine_weights(recipe: dict, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Run the importance-sampling lines of TRL's GRPOTrainer._generate_and_score_completions as
    TRL ships them, with the recipe's keys over GRPOConfig's defaults."""
    from trl_source import trl_source

    config = trl_source("trainer/grpo_config")
    defaults = {
        key: ast.literal_eval(re.search(rf"    {key}: [^=]+= field\(\s*default=([^,]+),", config).group(1))
        for key in (
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
        )
    }
    src = trl_source("trainer/grpo_trainer")
    start = src.index("                mask = completion_mask if tool_mask is None else completion_mask * tool_mask")
    end = src.index("            # Compute the per-token log probabilities for the reference model", start)
    settings = {k: recipe.get(k, v) for k, v in defaults.items()}
    if "vllm_importance_sampling_cap" in recipe:  # GRPOConfig.__post_init__ moves the deprecated name over
        settings["vllm_importance_sampling_clip_max"] = recipe["vllm_importance_sampling_cap"]
    scope = {"torch": torch, "math": math, "tool_mask": None, "completion_mask": mask}
    scope.update(old_per_token_logps=old, sampling_per_token_logps=sampling)
    scope["self"] = SimpleNamespace(**settings)
    exec(textwrap.dedent(src[start:end]), scope)
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize(
    "keys",
    [
        {},  # TRL's defaults: sequence_mask, clip_max 3
        {"vllm_importance_sampling_mode": "token_truncate"},
        {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": 0.5},
        {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 1.5},
        {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5},  # IcePop-like
        {
            "vllm_importance_sampling_mode": "token_mask",
            "vllm_importance_sampling_clip_max": None,
            "vllm_importance_sampling_clip_min": 0.8,
        },
        {"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_max": 1.2},
        {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.3},
        {"vllm_importance_sampling_cap": 1.1, "vllm_importance_sampling_mode": "token_truncate"},  # deprecated name
    ],
)
def test_each_trl_importance_sampling_mode_converts_to_the_same_weights(keys):
    conv = convert_recipe({"use_vllm": True, "max_steps": 1, **keys})
    assert not conv.notes or all("importance" not in n for n in conv.notes)  # mapped, not approximated
    a = config_from_dict(conv.config).algo
    torch.manual_seed(0)
    old = torch.randn(6, 5) * 0.5 - 1.0
    sampling = old + torch.randn(6, 5)
    sampling[2, 1] = float("nan")  # a token the engine could not score
    mask = torch.ones(6, 5)
    mask[4, 3:] = 0.0
    ours = engine_mismatch_weights(old, sampling, mask, a.engine_is_mode, a.engine_is_cap, a.engine_is_min)
    theirs = _trl_engine_weights(keys, old, sampling, mask)
    assert a.engine_is_correction and ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    raw = torch.exp(engine_log_ratio(old, sampling, mask, per_sequence=ours.shape[-1] == 1))
    assert 0 < int((ours != raw).sum())  # the bounds changed some weight: the case tests them


def test_trl_018_had_no_engine_correction():
    conv = convert_recipe({"use_vllm": True, "max_steps": 1}, defaults="0.18")
    assert conv.config["algo"]["engine_is_correction"] is False


def test_a_recipe_value_of_the_wrong_kind_is_named_with_its_key():
    from plait.config import ConfigError

    for recipe, said in [
        ({"learning_rate": "abc"}, "TRL recipe: learning_rate: 'abc' could not be read"),
        ({"max_steps": "two"}, "TRL recipe: max_steps: 'two' could not be read"),
    ]:
        with pytest.raises(ConfigError) as err:
            convert_recipe(recipe)
        assert said in str(err.value)


def test_the_batch_note_adds_up_when_the_batch_is_not_whole_groups():
    notes = convert_recipe({"num_generations": 3, "per_device_train_batch_size": 4}).notes
    batch = next(n for n in notes if n.startswith("batch:"))
    assert "= 4 completions per optimizer step, 3 in whole groups = 1 prompts x 3 generations" in batch, batch


def test_a_reward_given_as_trls_import_path_is_imported():
    out = convert_recipe({"reward_funcs": ["format", "my_pkg.judges.score"], "reward_weights": [1.0, 0.5]})
    assert {"name": "my_pkg.judges:score", "weight": 0.5} in out.config["rewards"]
    assert any("imported as my_pkg.judges:score" in n for n in out.notes)
