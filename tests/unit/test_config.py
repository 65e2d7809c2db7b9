import pytest
import torch
import yaml

from plait.config import Config, ConfigError, describe_options, load_config, validate


def problems_of(overrides, **kw):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), **kw)
    return err.value.problems


def test_defaults_are_the_demo_and_valid():
    cfg = load_config()
    plan = validate(cfg, world_size=1)
    assert cfg.model.name_or_path == "smollm2-135m-instruct" and cfg.data.task == "arithmetic"
    assert plan.completions_per_step == cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    assert plan.gradient_accumulation_steps * plan.micro_batch_size == plan.completions_per_step


def test_seed_004_four_gpus_one_for_generation():
    """Seed 004: 4 GPUs, 1 runs generation, num_generations 8, one completion per device batch."""
    probs = problems_of(
        [
            "cluster.devices=4",
            "cluster.generation_devices=1",
            "rollout.num_generations=8",
            "train.micro_batch_size=1",
            "rollout.prompts_per_step=4",
        ]
    )
    batch = next(p for p in probs if p.startswith("batch arithmetic"))
    # the arithmetic with the user's numbers ...
    assert "rollout.prompts_per_step=4 x rollout.num_generations=8 = 32 completions" in batch
    assert "3 training processes (4 devices - 1 for generation)" in batch
    assert "4 prompts / 3 processes = 1.33 is not whole" in batch
    # ... and the values that would work with 3 training processes
    assert "rollout.prompts_per_step in [3, 6, 9, 12]" in batch
    assert "training processes in [1, 2, 4]" in batch


def test_micro_batch_that_does_not_divide_lists_working_values():
    probs = problems_of(["rollout.prompts_per_step=3", "rollout.num_generations=6", "train.micro_batch_size=4"])
    (batch,) = [p for p in probs if p.startswith("batch arithmetic")]
    assert "Each process gets 18 completions, which is not a multiple of 4" in batch
    assert "train.micro_batch_size in [1, 2, 3, 6, 9, 18]" in batch
    assert "rollout.num_generations in" in batch and "4" in batch.split("rollout.num_generations in")[1][:30]


def test_explicit_accumulation_must_match():
    probs = problems_of(
        [
            "rollout.prompts_per_step=4",
            "rollout.num_generations=4",
            "train.micro_batch_size=4",
            "train.gradient_accumulation_steps=3",
        ]
    )
    assert any("= 4 micro-batches of 4, not 3" in p and "train.gradient_accumulation_steps=4" in p for p in probs)


def test_auto_batch_picks_fitting_values_and_says_so():
    cfg = load_config(
        None,
        [
            "cluster.devices=4",
            "cluster.generation_devices=1",
            "rollout.engine=hf",
            "rollout.prompts_per_step=4",
            "train.micro_batch_size=5",
            "train.auto_batch=true",
        ],
    )
    with pytest.raises(ConfigError) as err:  # the hf engine can't use generation devices ...
        validate(cfg)
    assert not any(p.startswith("batch arithmetic") for p in err.value.problems)  # ... but the batch was fixed
    plan = validate(
        load_config(
            None,
            ["cluster.devices=3", "rollout.prompts_per_step=4", "train.micro_batch_size=5", "train.auto_batch=true"],
        )
    )
    assert (plan.prompts_per_step, plan.micro_batch_size, plan.gradient_accumulation_steps) == (6, 4, 4)
    assert any("prompts_per_step 4 -> 6" in n for n in plan.notes)


def test_unknown_keys_get_the_nearest_name():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.learning_rat=1e-5", "rollouts.num_generations=4", "rewards.0.wieght=2"])
    msg = str(err.value)
    assert "unknown key 'train.learning_rat'. Did you mean 'learning_rate'?" in msg
    assert "unknown key 'rollouts'. Did you mean 'rollout'?" in msg
    assert "unknown key 'rewards.0.wieght'. Did you mean 'weight'?" in msg
    assert "3 problem(s)" in msg


def test_an_option_in_the_wrong_section_or_under_another_trainers_name_is_placed():
    """An option written in the wrong section (or none) names the section that has it; the names
    other trainers give the prompt file and its columns name plait's, TRL's own options say how
    a TRL recipe converts (or what plait does instead); a near misspelling in the right section
    still gets the nearest name."""
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "train.temperature=0.7",
                "learning_rate=1e-5",
                "data.train_files=t.jsonl",
                "data.input_key=q",
                "train.lr_schedular=cosine",
            ],
        )
    assert sorted(err.value.problems) == sorted(
        [
            "unknown key 'learning_rate'. It belongs to a section: 'train.learning_rate'.",
            "unknown key 'data.train_files'. plait calls it 'data.path'.",
            "unknown key 'data.input_key'. plait calls it 'data.prompt_field'.",
            "unknown key 'train.temperature'. It belongs to another section: 'rollout.temperature'.",
            "unknown key 'train.lr_schedular'. Did you mean 'lr_scheduler'?",
        ]
    ), err.value.problems
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.num_train_epochs=3", "report_to=wandb"])
    epochs, report = err.value.problems
    assert "'num_train_epochs' is a TRL option: `plait convert-config RECIPE.yaml`" in epochs, epochs
    assert report == "unknown key 'report_to'. 'report_to' is a TRL option; in plait: set log.tensorboard / log.wandb."


def test_type_and_choice_errors_name_the_field():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algo.loss_type=ppo", "train.learning_rate=fast"])
    msg = str(err.value)
    assert "algo.loss_type" in msg and "'grpo'" in msg and "'ppo'" in msg
    assert "train.learning_rate" in msg


def test_infinite_and_nan_numbers_are_refused_by_field():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.learning_rate=.inf", "train.max_grad_norm=-.inf", "rewards.0.weight=.nan"])
    problems = err.value.problems
    assert any(p.startswith("train.learning_rate: Input should be a finite number") for p in problems)
    assert any(p.startswith("train.max_grad_norm: Input should be a finite number") for p in problems)
    assert any(p.startswith("rewards.0.weight: Input should be a finite number") for p in problems)


def test_contradictions_are_all_reported_at_once():
    probs = problems_of(
        [
            "algo.epsilon=0.3",
            "algo.epsilon_high=0.2",
            "rollout.temperature=0",
            "rewards=[]",
            "data.path=/nope.jsonl",
            "model.name_or_path=/no/such/model",
            "train.warmup_steps=1000",
        ]
    )
    text = "\n".join(probs)
    assert "epsilon_high=0.2 is below algo.epsilon=0.3" in text
    assert "temperature=0" in text
    assert "rewards is empty" in text
    assert "/nope.jsonl' does not exist" in text
    assert "'/no/such/model' does not exist" in text
    assert "warmup_steps=1000" in text
    assert len(probs) >= 6


def test_unknown_reward_and_task_suggest_names():
    probs = problems_of(["rewards=[{name: acuracy}]", "data.task=arithmatic"])
    text = "\n".join(probs)
    assert "Did you mean 'accuracy'?" in text
    assert "Did you mean 'arithmetic'?" in text


def test_yaml_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"train": {"learning_rate": 3e-6}, "rollout": {"num_generations": 4}}))
    cfg = load_config(f, ["train.learning_rate=1e-6", "rewards.2.weight=2", "rollout.stop=['</answer>']"])
    assert cfg.train.learning_rate == 1e-6 and cfg.rollout.num_generations == 4
    assert cfg.rewards[2].weight == 2 and cfg.rewards[2].name == "boxed_format"
    assert cfg.rollout.stop == ["</answer>"]
    # the resolved config round-trips
    again = Config.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_a_key_given_twice_in_a_config_file_is_named_with_its_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_steps: 3\nrollout:\n  num_generations: 4\ntrain:\n  learning_rate: 1.0e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert f"{f}:5:1: not valid YAML: 'train' is given twice" in str(err.value)
    f.write_text("train:\n  max_steps: 3\n  max_steps: 4\n")  # inside a section too
    with pytest.raises(ConfigError, match="'max_steps' is given twice"):
        load_config(f)


def test_an_override_that_is_not_the_yaml_it_meant_says_to_quote_it():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_steps=[1"])
    assert "override 'train.max_steps=[1': the value is read as YAML and is not valid YAML" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.system_prompt=Answer: {x}"])
    assert "read as YAML, which made it a mapping: put it in quotes" in str(err.value)
    assert load_config(None, ["data.system_prompt='Answer: {x}'"]).data.system_prompt == "Answer: {x}"


def test_every_option_is_described():
    rows = describe_options()
    names = {r[0] for r in rows}
    assert {"train.learning_rate", "rollout.num_generations", "algo.loss_type", "rewards", "model.lora"} <= names
    undocumented = [n for n, _, meaning in rows if not meaning]
    assert undocumented == []


def test_train_help_lists_every_option(capsys):
    from plait.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name, default, _ in describe_options():
        assert f"{name} = {default}" in out


@pytest.mark.parametrize(
    "path", sorted(__import__("pathlib").Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.rewards and cfg.train.max_steps > 0
    # `plait train --seeds` sets each run's seed and directory on a copy: an assignment
    # re-validates the whole config, and must keep what the file said
    run = cfg.model_copy(deep=True)
    run.seed, run.output_dir = 7, "runs/seed-7"
    assert run.model_dump(exclude={"seed", "output_dir"}) == cfg.model_dump(exclude={"seed", "output_dir"})


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    from plait.cli import main

    assert main(["check", "--set", "train.lerning_rate=1"]) == 2
    assert "Did you mean 'learning_rate'?" in capsys.readouterr().err


def test_algorithm_options_are_checked_against_each_other():
    probs = problems_of(
        [
            "algo.ref_model_sync_steps=10",
            "algo.kl_in_reward=true",
            "algo.delta=1.1",
            "algo.entropy_coeff=0.01",
            "algo.top_entropy_quantile=0.2",
            "algo.cispo_cap=5",
            "algo.kl_bias_correction=true",
        ]
    )
    text = "\n".join(probs)
    assert "algo.cispo_cap caps CISPO's weight; with loss_type=dapo drop it" in text
    assert "algo.kl_bias_correction weights the KL term of the loss: it needs algo.beta > 0" in text
    assert "ref_model_sync_steps > 0 but algo.beta = 0: there is no reference model" in text
    assert "kl_in_reward=true needs algo.beta > 0" in text
    assert "algo.delta=1.1 must exceed 1 + epsilon_high = 1.2" in text
    assert "entropy_coeff with top_entropy_quantile < 1" in text
    probs = problems_of(
        [
            "algo.loss_type=cispo",
            "algo.importance_sampling_level=sequence",
            "algo.beta=0.1",
            "algo.ref_model_sync_steps=5",
            "model.lora={r: 4}",
        ]
    )
    text = "\n".join(probs)
    assert "cispo weights each token by its own ratio" in text
    assert "ref_model_sync_steps with LoRA" in text


def test_warmup_counts_every_optimizer_step():
    cfg = load_config(
        None, ["train.max_steps=2", "algo.num_iterations=2", "algo.steps_per_generation=2", "train.warmup_steps=8"]
    )
    validate(cfg)  # 2 x 2 x 2 = 8 optimizer steps: fits
    (msg,) = problems_of(["train.max_steps=2", "algo.num_iterations=2", "train.warmup_steps=5"])
    assert "train.warmup_steps=5 is longer than the run (4 optimizer steps)" in msg


def test_the_default_warmup_shrinks_to_a_one_round_smoke_test_and_a_set_one_is_kept():
    cfg = load_config(None, ["train.max_steps=1"])  # what a new user tries first
    validate(cfg)
    assert cfg.train.warmup_steps == 1
    assert load_config(None, ["train.max_steps=1", "algo.num_iterations=2"]).train.warmup_steps == 2
    assert load_config().train.warmup_steps == 2
    (msg,) = problems_of(["train.max_steps=1", "train.warmup_steps=2"])  # the user's own value: refused, not changed
    assert "train.warmup_steps=2 is longer than the run (1 optimizer steps)" in msg


def test_backend_choices_are_checked_against_the_launch(monkeypatch):
    from plait.config import resolve_backend

    cfg = load_config()
    assert resolve_backend(cfg, 1) == "local" and resolve_backend(cfg, 4) == "ddp"
    monkeypatch.setenv("WORLD_SIZE", "2")
    found = problems_of(["train.backend=local", "rollout.prompts_per_step=8"])
    assert any("train.backend=local trains in one process, but 2" in p and "ddp" in p for p in found)
    found = problems_of(["train.backend=fsdp2", "model.lora={r: 8}", "cluster.devices=4"])
    assert any("model.lora with train.backend=fsdp2" in p for p in found)
    assert any("cluster.devices=4 = 4 training processes, but the launcher started 2 (WORLD_SIZE)" in p for p in found)
    # generation devices are not training processes: 3 devices - 1 for vLLM = 2 trainers matches WORLD_SIZE=2
    assert not any("launcher started" in p for p in problems_of(["cluster.devices=3", "cluster.generation_devices=1"]))
    found = problems_of(["cluster.devices=4", "cluster.generation_devices=1"])
    assert any("cluster.devices=4 - generation_devices=1 = 3 training processes" in p for p in found)
    found = problems_of(
        [
            "train.backend=deepspeed",
            "train.deepspeed.zero_stage=2",
            "train.deepspeed.offload_params=true",
            "algo.beta=0.1",
            "algo.ref_model_sync_steps=4",
        ]
    )
    assert any("offload_params needs train.deepspeed.zero_stage=3" in p for p in found)
    assert any("ref_model_sync_steps with train.backend=deepspeed" in p for p in found)


def test_resume_refuses_a_checkpoint_of_another_backend(tmp_path):
    import json

    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "COMMITTED").write_text("ok")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "backend": "fsdp2", "world_size": 2}))
    found = problems_of([f"output_dir={tmp_path}", "resume=auto", "train.backend=ddp"], world_size=2)
    assert any("written by train.backend=fsdp2 and can't be read by ddp" in p for p in found)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "backend": "deepspeed", "world_size": 4}))
    found = problems_of([f"output_dir={tmp_path}", "resume=auto", "train.backend=deepspeed"], world_size=2)
    assert any("DeepSpeed shards for 4 processes, but 2 were launched" in p for p in found)
    # local and ddp share a format
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "backend": "local", "world_size": 1}))
    validate(load_config(None, [f"output_dir={tmp_path}", "resume=auto", "train.backend=ddp"]), world_size=2)


def test_resume_of_a_directory_that_holds_no_run_is_refused(tmp_path, capsys):
    from plait.cli import main

    (tmp_path / "empty").mkdir()
    for folder, why in [(tmp_path / "nope", "does not exist"), (tmp_path / "empty", "has no config.yaml")]:
        assert main(["train", "--resume", str(folder)]) == 2
        err = capsys.readouterr().err
        assert f"--resume {folder}: that directory {why}" in err and f"--output-dir {folder}" in err
    assert not (tmp_path / "nope").exists() and list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize(
    "override, named",
    [
        ("train.learning_rate=1e-3", "train.learning_rate=0.001 (the run's: 3e-05)"),
        ("train.adam_beta1=0.8", "train.adam_beta1=0.8 (the run's: 0.9)"),
        ("train.adam_beta2=0.95", "train.adam_beta2=0.95 (the run's: 0.99)"),
        ("train.weight_decay=0.1", "train.weight_decay=0.1 (the run's: 0.0)"),
    ],
)
def test_resume_refuses_optimizer_settings_the_checkpoint_would_override(
    override, named, tmp_path, tiny_model_path, capsys
):
    import json

    from plait.cli import main

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "COMMITTED").write_text("ok")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "backend": "local", "world_size": 1}))
    saved = load_config(None, [f"model.name_or_path={tiny_model_path}", f"output_dir={run}"]).to_yaml()
    (run / "config.yaml").write_text(saved)
    assert main(["train", "--resume", str(run), "--set", override]) == 2
    err = capsys.readouterr().err
    assert named in err and "would not take effect" in err
    assert err.count("(the run's: ") == 1  # the one changed setting, no other
    assert (run / "config.yaml").read_text() == saved  # refused before the run directory is touched
    # what the checkpoint does not hold may change: a longer run
    validate(load_config(run / "config.yaml", ["resume=auto", "train.max_steps=50"]))


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert (
        f"output_dir '{taken}' is a file, so no run directory can be made there"
        in problems_of([f"output_dir={taken}"])[0]
    )
    found = problems_of([f"output_dir={taken}/run"])
    assert any(f"lies under '{taken}', which is a file" in p for p in found)
    validate(load_config(None, [f"output_dir={tmp_path}/new/run"]))


def test_lora_target_modules_that_match_no_module_are_named_before_the_model_loads(tiny_model_path):
    base = [f"model.name_or_path={tiny_model_path}"]
    found = problems_of([*base, "model.lora.target_modules=[q_proj, qkv_proj]"])
    assert found == [
        f"model.lora.target_modules: ['qkv_proj'] match no module of {tiny_model_path}; its linear layers are "
        "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj'] "
        "(or use target_modules: all-linear)"
    ]
    validate(load_config(None, [*base, "model.lora.target_modules=[q_proj, v_proj]"]))


def test_deepspeed_json_follows_the_batch_arithmetic_and_merges_extra():
    from plait.train.backends.deepspeed import deepspeed_config

    cfg = load_config(
        None,
        [
            "train.micro_batch_size=4",
            "train.gradient_accumulation_steps=2",
            "train.deepspeed.offload_optimizer=true",
            "train.deepspeed.extra={zero_optimization: {overlap_comm: true}, steps_per_print: 5}",
        ],
    )
    ds = deepspeed_config(cfg, world_size=8)
    assert ds["train_batch_size"] == 4 * 2 * 8 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
    }
    assert ds["steps_per_print"] == 5 and ds["gradient_clipping"] == 1.0


def test_async_generation_options_are_checked():
    with pytest.raises(ConfigError, match="greater than or equal to 0"):
        load_config(None, ["rollout.max_staleness=-1"])
    colocated = "\n".join(problems_of(["rollout.engine=vllm", "rollout.max_staleness=1"]))
    assert "a colocated vLLM engine shares the training process" in colocated
    assert "rollout.vllm.mode=server" in colocated and "rollout.engine=hf" in colocated
    assert "set rollout.max_staleness >= 1" in "\n".join(problems_of(["rollout.inflight_updates=true"]))
    vllm = problems_of(
        ["rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.max_staleness=2", "rollout.inflight_updates=true"]
    )
    assert any("inflight_updates=true needs rollout.engine=hf" in p for p in vllm)
    validate(load_config(None, ["rollout.max_staleness=2", "rollout.inflight_updates=true"]))  # hf: fine
    validate(load_config(None, ["rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.max_staleness=1"]))


def test_own_data_alone_turns_the_built_in_task_off(tmp_path):
    cfg = load_config(None, ["data.path=prompts.jsonl"])
    assert cfg.data.task is None and cfg.data.path == "prompts.jsonl"
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  path: prompts.jsonl\n  prompt_field: question\n")
    assert load_config(str(f), []).data.task is None
    assert load_config(None, []).data.task == "arithmetic"  # the demo stays the default
    both = problems_of(["data.path=prompts.jsonl", "data.task=arithmetic"])
    assert any("both data.task ('arithmetic') and data.path" in p and "remove one" in p for p in both)
    neither = problems_of(["data.task=null"])
    assert any("set data.path (your prompts) or data.task" in p for p in neither)


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    from plait.cli import main

    bad = tmp_path / "run.yaml"
    bad.write_text("rollout:\n  num_generations: 8\n   temperature: 1.0\n")
    with pytest.raises(ConfigError, match=r"run.yaml:3:15: not valid YAML: mapping values are not allowed here"):
        load_config(str(bad), [])
    assert main(["check", str(bad)]) == 2
    assert "run.yaml:3:15: not valid YAML" in capsys.readouterr().err


def test_a_run_is_named_after_its_data_and_model():
    from plait.train.rundir import default_run_dir, run_name

    assert run_name(load_config(None, [])) == "arithmetic-smollm2-135m-instruct"
    own = load_config(None, ["data.path=/data/gsm8k_train.jsonl", "model.name_or_path=/models/Qwen2.5-0.5B/"])
    assert run_name(own) == "gsm8k_train-Qwen2.5-0.5B"
    assert default_run_dir(own).name.startswith("gsm8k_train-Qwen2.5-0.5B-")
    assert run_name(load_config(None, ["name=mine"])) == "mine"


def test_estimator_options_that_belong_to_another_estimator_are_refused():
    probs = problems_of(["algo.advantage_estimator=reinforce_pp", "algo.scale_rewards=group"])
    assert any("whitens the returns over the whole batch" in p and "scale_rewards" in p for p in probs)
    probs = problems_of(["algo.advantage_estimator=rloo", "algo.reward_aggregation=normalize_then_sum"])
    assert any("use sum_then_normalize, or advantage_estimator=grpo" in p for p in probs)
    with pytest.raises(ConfigError, match="grpo.*rloo.*opo.*reinforce_pp"):
        load_config(None, ["algo.advantage_estimator=ppo"])
    for est in ("rloo", "opo", "reinforce_pp", "reinforce_pp_baseline"):
        validate(load_config(None, [f"algo.advantage_estimator={est}"]), world_size=1)


def test_rollout_precision_is_checked_and_auto_follows_the_trainer_where_bf16_is_native(monkeypatch):
    import plait.rollout.precision as precision
    from plait.rollout.precision import rollout_precision

    int8 = "rollout.precision=int8"
    assert any("for vLLM set rollout.precision=bf16" in p for p in problems_of([int8, "rollout.engine=vllm"]))
    inflight = problems_of([int8, "rollout.max_staleness=1", "rollout.inflight_updates=true"])
    assert any("swaps them mid-call" in p for p in inflight)
    validate(load_config(None, [int8, "rollout.max_staleness=1"]))  # a generation process quantizes per call
    bf16 = load_config(None, ["train.precision=bf16"])
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: False)
    assert rollout_precision(bf16, torch.device("cpu")) == "fp32"  # emulated bf16 is several times slower
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: True)
    assert rollout_precision(bf16, torch.device("cpu")) == "bf16"  # packed bf16 weights on AVX512_BF16/AMX
    assert rollout_precision(load_config(None, ["train.precision=fp32"]), torch.device("cpu")) == "fp32"
    assert rollout_precision(bf16, torch.device("cuda")) == "bf16"
    assert rollout_precision(load_config(None, ["train.precision=bf16", "rollout.engine=vllm"])) == "bf16"
    assert rollout_precision(load_config(None, ["train.precision=fp32", "rollout.precision=bf16"])) == "bf16"


def test_int8_rollouts_warn_where_the_cpu_has_no_vnni(monkeypatch):
    import plait.train.setup as setup
    from plait.train.backends import make_backend

    cfg = load_config(None, ["rollout.precision=int8", "train.precision=fp32"])
    plan, backend = validate(cfg), make_backend("local", cfg, torch.device("cpu"))
    for full_range in (True, False):
        said: list[str] = []
        monkeypatch.setattr(setup, "int8_full_range", lambda f=full_range: f)
        resolved = setup.resolved_config(cfg, plan, backend, said.append)
        assert resolved.rollout.precision == "int8" and resolved.algo.engine_is_correction
        warned = [s for s in said if "without VNNI" in s]
        assert bool(warned) != full_range, said
    assert "rollout.precision=fp32 is faster there" in warned[0]


def test_auto_precision_is_bf16_where_the_cpu_multiplies_it_and_says_why(monkeypatch):
    import plait.models as models
    from plait.models import cpu_flags

    monkeypatch.delenv("PLAIT_AUTO_PRECISION", raising=False)
    native = bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and torch.backends.cpu.get_cpu_capability() != "AVX2"
    if not torch.cuda.is_available():  # this machine, undisturbed
        assert load_config(None, []).train.precision == ("bf16" if native else "fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for has_units, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(models, "native_bf16_cpu", lambda has=has_units: has)
        cfg = load_config(None, [])
        assert cfg.train.precision == want
        assert ("in hardware" in cfg.train.precision_auto) == has_units
        again = Config.model_validate(yaml.safe_load(cfg.to_yaml()))  # the resolved config names it
        assert again.train.precision == want and again.train.precision_auto is None
    monkeypatch.setattr(models, "native_bf16_cpu", lambda: True)
    determined = load_config(None, ["train.deterministic=true"]).train
    assert determined.precision == "fp32" and determined.precision_auto == "train.deterministic"
    named = load_config(None, ["train.precision=fp32"]).train
    assert named.precision == "fp32" and named.precision_auto is None
    monkeypatch.setenv("PLAIT_AUTO_PRECISION", "fp32")
    pinned = load_config(None, []).train
    assert pinned.precision == "fp32" and "PLAIT_AUTO_PRECISION" in pinned.precision_auto


def test_the_drift_limit_follows_the_coarser_precision():
    from plait.train.guard import EngineDrift, check_drift

    int8 = load_config(None, ["train.precision=fp32", "rollout.precision=int8"])
    check_drift(int8, 3, 0.8, sampled_version=2)  # int8's own rounding (SmolLM2-135M: 0.14-0.85)
    with pytest.raises(EngineDrift, match=r"limit 2: rollout.max_logprob_gap, rollouts int8, training fp32"):
        check_drift(int8, 3, 3.0, sampled_version=2)
    check_drift(load_config(None, ["train.precision=bf16", "rollout.precision=fp32"]), 3, 0.05, 2)  # bf16's limit


def test_plait_check_reports_every_stage_s_problems_in_one_pass(tmp_path, capsys):
    """Two misspelt keys, a misspelt reward name and a cross-field problem: one `plait check` names
    all four (an unknown key does not hide the checks behind it); a value out of range hides
    nothing either: the checks after validation run with it at its default, in the same pass,
    and so does `plait train`, before anything loads."""
    from plait.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "train:\n  lerning_rate: 1e-5\nrollout:\n  num_generatons: 8\n  temperature: 0.9\n"
        "rewards:\n  - name: acuracy\nalgo:\n  kl_in_reward: true\n"
    )
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    for said in ("'train.lerning_rate'", "'rollout.num_generatons'", "unknown reward 'acuracy'", "kl_in_reward"):
        assert said in err, err
    assert main(["check", str(cfg), "--set", "rollout.temperature=-1"]) == 2
    err = capsys.readouterr().err
    for said in ("'train.lerning_rate'", "rollout.temperature", "unknown reward 'acuracy'", "kl_in_reward"):
        assert said in err, err
    out = tmp_path / "never"
    assert main(["train", str(cfg), "--set", "train.learning_rate=-1", "--set", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    for said in ("'train.lerning_rate'", "train.learning_rate", "unknown reward 'acuracy'", "kl_in_reward"):
        assert said in err, err
    assert not out.exists()


def test_the_checks_after_a_refused_value_say_nothing_of_its_default(tiny_model_path, tmp_path, capsys):
    """A refused value is replaced by its default for the checks that follow validation; a
    problem they find that names it is about a value the user did not write, so it is not
    reported (the tiny model has 1024 positions: the default prompt length 256 + 900 would not
    fit, 200 + 900 does not either and is said)."""
    from plait.cli import main

    model = [f"model.name_or_path={tiny_model_path}", "rollout.max_completion_length=900"]
    args = ["check", *(x for o in model for x in ("--set", o)), "--set", "rewards.0.name=acuracy"]
    assert main([*args, "--set", "data.max_prompt_length=0"]) == 2
    err = capsys.readouterr().err
    assert "data.max_prompt_length: Input should be greater than or equal to 1" in err, err
    assert "unknown reward 'acuracy'" in err and "exceeds the model's" not in err, err
    assert main([*args, "--set", "data.max_prompt_length=200"]) == 2
    err = capsys.readouterr().err
    assert "data.max_prompt_length=200 + rollout.max_completion_length=900 exceeds the model's 1024" in err, err
