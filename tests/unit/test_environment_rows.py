"""reasoning-gym environments: rows that rebuild their problem where they are scored, the
dataset's own verifier as the reward, failures counted as infrastructure errors, and the
checks `plait check` makes before a model loads."""

import json

import pytest

from plait.config import ConfigError, load_config, validate
from plait.data import SYSTEM_COLUMN, load_rows
from plait.programs.environments import environment, environment_rows, train_sizes
from plait.train.metrics import environment_metrics


pytest.importorskip("reasoning_gym")

ARITH = "{type: reasoning_gym, dataset: basic_arithmetic, config: {min_terms: 2, max_terms: 2, max_digits: 1}"
LEGS = "{type: reasoning_gym, dataset: leg_counting, config: {min_animals: 1, max_animals: 2}"


def config(*envs: str, extra=()):
    return load_config(None, ["environments=[" + ", ".join(envs) + "]", *extra])


def test_rows_are_seeded_and_rebuild_their_problem_where_scored():
    cfg = config(ARITH + ", size: 20, eval_size: 10}", LEGS + ", size: 10, answer_format: boxed}")
    rows = load_rows(cfg.data, "train", 3, cfg.environments)
    assert [r["environment"] for r in rows] == ["basic_arithmetic"] * 20 + ["leg_counting"] * 10
    assert rows == load_rows(cfg.data, "train", 3, cfg.environments)  # the same seed, the same problems
    assert rows != load_rows(cfg.data, "train", 4, cfg.environments)
    # the row carries where its problem came from, not the entry: JSON-safe, and enough to score
    json.dumps(rows)
    for row in (rows[0], rows[25]):
        fmt = row["env_source"]["answer_format"]
        right = f"<answer>{row['answer']}</answer>" if fmt == "answer_tag" else f"so \\boxed{{{row['answer']}}}"
        scores = environment([right, "I don't know", "<answer>-12345</answer>"], [row["env_source"]] * 3)
        assert scores[:2] == [1.0, 0.0] and scores[2] < 1  # no answer: 0; a wrong one: the dataset's verdict
    # each environment asks for its own answer format: reasoning-gym's system prompt (unless
    # data.system_prompt is set), or an instruction after the question
    assert "<answer>" in rows[0][SYSTEM_COLUMN] and SYSTEM_COLUMN not in rows[25]
    assert rows[25]["prompt"].endswith("Put the final answer in \\boxed{}.")
    own = load_config(None, [f"environments=[{ARITH}, size: 5}}]", "data.system_prompt=Be brief."])
    assert all(SYSTEM_COLUMN not in r for r in load_rows(own.data, "train", 0, own.environments))


def test_the_eval_split_holds_no_training_problem():
    cfg = config(ARITH + ", size: 60, eval_size: 40}")
    train = {r["prompt"] for r in load_rows(cfg.data, "train", 0, cfg.environments)}
    held_out = load_rows(cfg.data, "eval", 0, cfg.environments)
    assert held_out and not train & {r["prompt"] for r in held_out}
    assert len(held_out) < 40  # one-digit sums repeat: the repeats were left out


def test_weights_split_the_sizes_sum():
    cfg = config(ARITH + ", size: 30, weight: 3}", LEGS + ", size: 10}")
    assert train_sizes(cfg.environments) == [30, 10]  # 40 split 3 : 1
    cfg = config(ARITH + ", size: 10}", LEGS + ", size: 30}")
    assert train_sizes(cfg.environments) == [10, 30]  # no weights: the sizes
    rows = environment_rows(
        config(ARITH + ", size: 30, weight: 1}", LEGS + ", size: 10}").environments, "train", 0, None
    )
    assert sum(r["environment"] == "basic_arithmetic" for r in rows) == 20


def test_a_failing_environment_is_an_infrastructure_error_not_a_score(caplog):
    row = environment_rows(config(ARITH + ", size: 2}").environments, "train", 0, None)[0]
    broken = {**row["env_source"], "dataset": "no_such_dataset"}
    assert environment(["<answer>1</answer>", "<answer>1</answer>"], [broken, None]) == [None, None]
    # one warning for the call, with the count and the cause (not one per failed completion)
    warned = [r.getMessage() for r in caplog.records if "no_such_dataset" in r.getMessage()]
    assert len(warned) == 1 and "environment no_such_dataset failed on 1 of 2 completions" in warned[0], warned
    assert "not registered" in warned[0]
    # counted per environment, and left out of its mean score
    from plait.types import Completion, Group, Prompt

    def group(label, scores):
        c = Completion(
            prompt_index=0, token_ids=[1, 2], text="", logprobs=[0.0, 0.0], truncated=False, finish_reason="eos"
        )
        p = Prompt(0, "", [1], columns={"environment": label})
        return Group(p, [c] * len(scores), {"environment": scores}, [s or 0.0 for s in scores])

    m = environment_metrics([group("a", [1.0, None]), group("b", [0.0, 0.0])])
    assert (m["env/a/errors"], m["env/a/score_mean"], m["env/a/completions"]) == (1.0, 1.0, 2.0)
    assert (m["env/b/errors"], m["env/b/score_mean"]) == (0.0, 0.0)


def test_an_answer_that_breaks_the_verifier_scores_zero_where_the_verifier_scores_its_own_answer():
    """prime_factorization's verifier calls int() on each factor: an answer that is not a product
    of numbers raises there. It scores the problem's reference answer, so the answer, not the
    environment, is at fault: 0, not an infrastructure error."""
    spec = "{type: reasoning_gym, dataset: prime_factorization, size: 2, answer_format: boxed}"
    row = environment_rows(config(spec).environments, "train", 0, None)[0]
    texts = [f"\\boxed{{{row['answer']}}}", "\\boxed{2 x 3}", "\\boxed{I don't know}", "no idea"]
    from plait.programs.reasoning_gym import dataset

    ds = dataset(row["env_source"])
    with pytest.raises(ValueError):  # the verifier itself raises on such an answer
        ds.score_answer(answer="I don't know", entry=ds[row["env_source"]["index"]])
    assert environment(texts, [row["env_source"]] * 4, unformatted_credit=0.5) == [1.0, 0.0, 0.0, 0.0]


def test_environments_replace_the_task_and_bring_their_reward_and_metric():
    cfg = config(ARITH + "}")
    assert cfg.data.task is None and [r.name for r in cfg.rewards] == ["environment"]
    assert cfg.eval.metric == "environment"
    validate(cfg, world_size=1)
    # the config's own choices stand
    cfg = load_config(None, [f"environments=[{ARITH}}}]", "rewards=[{name: accuracy}]", "eval.metric=accuracy"])
    assert [r.name for r in cfg.rewards] == ["accuracy"] and cfg.eval.metric == "accuracy"


def _problems(*overrides):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, list(overrides)), world_size=1)
    return "\n".join(err.value.problems)


def test_plait_check_names_each_environment_problem_and_its_fix():
    text = _problems("environments=[{type: reasoning_gym, dataset: leg_countin}]")
    assert "no dataset 'leg_countin'" in text and "leg_counting" in text
    text = _problems("environments=[{type: reasoning_gym, dataset: basic_arithmetic, config: {bogus: 1}}]")
    assert "could not build 'basic_arithmetic'" in text and "bogus" in text
    text = _problems("environments=[{type: reasoning_gym, dataset: rush_hour}]")
    assert "no reference answer" in text and "pick another dataset" in text
    text = _problems(f"environments=[{ARITH}}}, {ARITH}}}]")
    assert "labels must differ" in text
    text = _problems(f"environments=[{ARITH}}}]", "data.task=arithmetic")
    assert "environments and data.task ('arithmetic') both give prompts" in text
    text = _problems("rewards=[{name: environment}]")
    assert "but neither is configured" in text
    text = _problems("environments=[{type: reasoning_gym, dataset: composite, config: {datasets: []}}]")
    assert "'composite' is configured with its own Python objects; list its datasets as entries" in text
    with pytest.raises(ConfigError, match="reasoning_gym"):
        load_config(None, ["environments=[{type: gymnasium, dataset: x}]"])
    with pytest.raises(ConfigError, match="no verifiers release installs beside plait's dependencies"):
        load_config(None, ["environments=[{type: verifiers}]"])


def test_plait_check_scores_the_first_problems_answers_and_sees_each_rebuilt_as_asked():
    # codeio's problem 5 answers '{"s": "}[}}}{(]"}': no box holds it, an <answer> tag does
    text = _problems("environments=[{type: reasoning_gym, dataset: codeio, size: 20, answer_format: boxed}]")
    assert "scores its own reference answer to problem 5" in text and "answer_tag: a box cannot hold" in text
    # (codeio's prompts run to 3,359 tokens: the tokenizer's check refuses the default 256)
    codeio = ["environments=[{type: reasoning_gym, dataset: codeio, size: 20}]", "data.max_prompt_length=4096"]
    validate(load_config(None, codeio), world_size=1)
    # list_functions draws a new problem each time an entry is read: it cannot be rebuilt to score
    text = _problems("environments=[{type: reasoning_gym, dataset: list_functions, size: 20}]")
    assert "'list_functions' built another problem for entry 0 than the one asked" in text
    row = environment_rows(config(ARITH + ", size: 2}").environments, "train", 0, None)[0]
    other = {**row["env_source"], "problem": "0" * 16}  # a fingerprint the rebuilt problem does not match
    assert environment([f"<answer>{row['answer']}</answer>"], [other]) == [None]  # an infrastructure error


def test_plait_train_refuses_what_plait_check_refuses_before_its_run_directory_exists(tmp_path):
    """One registry of checks for both commands: the tokenizer's (prompts too long) included."""
    from plait.config.checks import CHECKS
    from plait.train.loop import train

    assert {c.needs for c in CHECKS} == {"config", "machine", "files", "tokenizer"}
    run = tmp_path / "run"
    overrides = ["environments=[{type: reasoning_gym, dataset: codeio, size: 20}]", f"output_dir={run}"]
    with pytest.raises(ConfigError) as err:
        train(load_config(None, overrides))
    assert "20 of 20 prompts are longer than data.max_prompt_length=256 tokens" in str(err.value)
    assert "\n".join(err.value.problems) == _problems(*overrides)  # what plait check says
    assert not run.exists()


def test_unformatted_credit_scores_an_answer_outside_the_asked_format():
    row = environment_rows(config(ARITH + ", size: 2, answer_format: boxed}").environments, "train", 0, None)[0]
    source, answer = row["env_source"], row["answer"]
    texts = [f"\\boxed{{{answer}}}", f"The sum is {answer}.", "The sum is 12345.", f"\\boxed{{12345}} or {answer}"]
    assert environment(texts, [source] * 4) == [1.0, 0.0, 0.0, 0.0]  # strict: only the box counts
    # a boxed wrong answer earns no credit: the credit is for an answer not yet in the format
    assert environment(texts, [source] * 4, unformatted_credit=0.5) == [1.0, 0.5, 0.0, 0.0]


def test_an_environment_without_a_new_held_out_problem_is_refused_when_evaluating():
    small = "{type: reasoning_gym, dataset: leg_counting, config: {min_animals: 1, max_animals: 1, max_instances: 2}"
    text = _problems(f"environments=[{small}, size: 300}}]", "eval.after=true")
    assert "none of its 50 held-out problems is new" in text and "widen its config" in text
    validate(
        load_config(None, [f"environments=[{small}, size: 300}}]", "eval.before=false", "eval.after=false"]),
        world_size=1,
    )


def test_an_environment_shows_its_own_worked_examples_before_each_of_its_prompts():
    from plait.data import build_prompts
    from plait.programs.environments import describe_shots

    class Chat:  # renders turns as text: enough to see what comes before the question
        chat_template = "yes"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "".join(f"<{m['role']}> {m['content']}\n" for m in messages) + "<assistant>"

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text.split())))}

    cfg = config(ARITH + ", size: 20, eval_size: 10, examples: 2, answer_format: boxed}", LEGS + ", size: 5}")
    train, held_out = (load_rows(cfg.data, split, 0, cfg.environments) for split in ("train", "eval"))
    shots = train[0]["_shots"]
    asked = [t["content"] for t in shots if t["role"] == "user"]
    # two problems of the same dataset, asked as the prompts ask, answered in the format asked for
    assert [t["role"] for t in shots] == ["user", "assistant"] * 2 and len(set(asked)) == 2
    assert all(q.endswith("Put the final answer in \\boxed{}.") for q in asked)
    assert all(t["content"].startswith("\\boxed{") for t in shots if t["role"] == "assistant")
    # none a training or held-out problem; every row of both splits shows the same ones
    assert not set(asked) & {r["prompt"] for r in train + held_out}
    arith = [r for r in train + held_out if r["environment"] == "basic_arithmetic"]
    assert all(r["_shots"] == shots for r in arith)
    assert all("_shots" not in r for r in train if r["environment"] == "leg_counting")  # examples: 0
    # each example's answer is the dataset's reference: its verifier gives it full marks
    from plait.programs.reasoning_gym import BOXED_INSTRUCTION, EXAMPLE_SEED_OFFSET, dataset

    source = {**arith[0]["env_source"], "seed": EXAMPLE_SEED_OFFSET, "size": 8 * 2 + 32}
    del source["problem"]  # the first row's fingerprint: these are other problems
    drawn = dataset(source)
    index = {f"{drawn[i]['question'].rstrip()}\n\n{BOXED_INSTRUCTION}": i for i in range(len(drawn))}
    for question, answer in zip(asked, [t["content"] for t in shots if t["role"] == "assistant"]):
        assert environment([answer], [{**source, "index": index[question]}]) == [1.0]
    # in the chat, before the question; not a column the rewards see
    prompts = build_prompts(train, Chat(), cfg.data)
    first = next(p for p in prompts if p.columns["environment"] == "basic_arithmetic")
    assert first.text.index(asked[0]) < first.text.index(asked[1]) < first.text.index(arith[0]["prompt"])
    assert "_shots" not in first.columns
    assert describe_shots(cfg.environments) == [
        "few-shot: 2 worked example(s) before every 'basic_arithmetic' prompt (the environment's examples)"
    ]
    # refused where they cannot be drawn, or where the rows come from data
    small = "{type: reasoning_gym, dataset: leg_counting, config: {min_animals: 1, max_animals: 1, max_instances: 2}"
    text = _problems(f"environments=[{small}, size: 300, examples: 2}}]", "eval.before=false", "eval.after=false")
    assert "only 0 of its 2 worked examples could be drawn" in text and "lower its examples" in text
    with pytest.raises(ConfigError, match="give worked examples there"):
        load_config(None, ["environments=[{type: trl_env, factory: 'm:E', examples: 1}]"])


def test_an_environment_shows_the_configs_own_worked_examples_with_their_working():
    from plait.programs.environments import describe_shots

    own = (
        "[{prompt: 'Calculate 52 + 7.', completion: '52 + 7 = \\boxed{59}'}, "
        "{prompt: 'Calculate 64 + 28.', completion: '64 + 28 = \\boxed{92}'}]"
    )
    cfg = config(ARITH + f", size: 20, eval_size: 10, answer_format: boxed, examples: {own}}}")
    validate(cfg, world_size=1)
    rows = load_rows(cfg.data, "train", 0, cfg.environments) + load_rows(cfg.data, "eval", 0, cfg.environments)
    # asked as every prompt of the environment is asked (the format's instruction added), answered as written
    assert rows[0]["_shots"] == [
        {"role": "user", "content": "Calculate 52 + 7.\n\nPut the final answer in \\boxed{}."},
        {"role": "assistant", "content": "52 + 7 = \\boxed{59}"},
        {"role": "user", "content": "Calculate 64 + 28.\n\nPut the final answer in \\boxed{}."},
        {"role": "assistant", "content": "64 + 28 = \\boxed{92}"},
    ]
    assert all(r["_shots"] == rows[0]["_shots"] for r in rows)
    assert describe_shots(cfg.environments) == [
        "few-shot: 2 worked example(s) before every 'basic_arithmetic' prompt (the config's own)"
    ]
    # an example without an answer in the format, or one that is a training problem, is refused
    train = load_rows(cfg.data, "train", 0, cfg.environments)[0]["prompt"].split("\n\n")[0]
    bad = (
        f"[{{prompt: 'Calculate 52 + 7.', completion: '52 + 7 = 59'}}, "
        f"{{prompt: '{train}', completion: '\\boxed{{1}}'}}]"
    )
    text = _problems(f"environments=[{ARITH}, size: 20, answer_format: boxed, examples: {bad}}}]")
    assert "worked example 0's completion gives no answer in \\boxed{...}" in text
    assert "worked example 1 is one of its own training or held-out problems" in text
    with pytest.raises(ConfigError, match="drop tool_output"):
        load_config(
            None, [f"environments=[{ARITH}, examples: [{{prompt: q, completion: c, tool_output: o, answer: a}}]}}]"]
        )
    with pytest.raises(ConfigError, match="give 0 to 8"):
        load_config(None, [f"environments=[{ARITH}, examples: 9}}]"])


def test_an_environment_whose_every_prompt_is_too_long_stops_the_run_before_training(tiny_model_path, capsys):
    from plait.data import DataError, build_prompts
    from plait.models import load_tokenizer

    tok = load_tokenizer(str(tiny_model_path))
    long = "{type: reasoning_gym, dataset: leg_counting, config: {min_animals: 3, max_animals: 4}, size: 4}"
    cfg = config(ARITH + ", size: 4}", long)
    rows = load_rows(cfg.data, "train", 0, cfg.environments)
    lengths = {}
    for p in build_prompts(rows, tok, cfg.data, log=None):
        lengths.setdefault(p.columns["environment"], []).append(len(p.token_ids))
    limit = max(lengths["basic_arithmetic"])
    assert limit < min(lengths["leg_counting"])  # the short sums fit, no animal question does
    cfg = config(ARITH + ", size: 4}", long, extra=[f"data.max_prompt_length={limit}"])
    with pytest.raises(DataError) as err:
        build_prompts(rows, tok, cfg.data, log=None)
    assert "every prompt of environment(s) leg_counting (" in str(err.value)
    assert "raise data.max_prompt_length" in str(err.value)
    # `plait check` finds it too, with the model's tokenizer (no model loads)
    from plait.cli import main

    over = [f"model.name_or_path={tiny_model_path}", f"data.max_prompt_length={limit}", "eval.before=false"]
    envs = "environments=[" + ARITH + ", size: 4}, " + long + "]"
    assert main(["check", *sum((["--set", o] for o in [envs, *over]), [])]) == 2
    assert "every prompt of environment(s) leg_counting (" in capsys.readouterr().err
    # when some of an environment's prompts fit, the rest are dropped as before, with a line saying so
    said = []
    cut = sorted(lengths["leg_counting"])[1]
    cfg = config(ARITH + ", size: 4}", long, extra=[f"data.max_prompt_length={cut}"])
    assert len(build_prompts(rows, tok, cfg.data, log=said.append)) < 8 and "prompts are longer than" in said[0]
    longest = max(lengths["leg_counting"])
    assert f"to keep them, raise data.max_prompt_length (the longest is {longest} tokens)" in said[0]
    # one environment alone: named too, with the length that fits; held-out prompts are called so
    cfg = config(long, extra=[f"data.max_prompt_length={limit}"])
    alone = load_rows(cfg.data, "train", 0, cfg.environments)
    for split, doing in (("train", "train"), ("eval", "be evaluated")):
        with pytest.raises(DataError) as err:
            build_prompts(alone, tok, cfg.data, log=None, split=split)
        assert "every prompt of environment(s) leg_counting (" in str(err.value)
        assert f"would not {doing} at all" in str(err.value) and "the longest is " in str(err.value)
        assert ("held-out prompts are longer" in str(err.value)) == (split == "eval")


def test_each_environment_type_is_a_model_of_its_own_options():
    """An entry is validated as its `type`'s model: an option another type has is named as
    that type's, a misspelt one gets the nearest name, every problem of the section at once;
    the resolved config reads back equal and `plait train --help` lists each type's options."""
    from plait.config import describe_options
    from plait.config.schema import Config, OpenEnvEnvironment, ReasoningGymEnvironment, TrlEnvironment

    entries = (
        "environments=[{type: trl_env, factory: 'm:E', dataset: x}, {type: reasoning_gym, dataset: basic_arithmetic,"
        " url: 'http://h:1', sise: 3}, {type: openenv, url: 'http://h:1', trusted: true}, {factory: 'm:E'}]"
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, [entries])
    said = err.value.problems
    assert any(p.startswith("`dataset` is for environments of type reasoning_gym, not trl_env") for p in said)
    assert any("`url` is for environments of type openenv, not reasoning_gym" in p for p in said)
    assert any("unknown key 'environments.1.sise'. Did you mean 'size'?" in p for p in said)
    assert any(
        "`trusted` is for environments of type trl_env, not openenv" in p and "not in plait's sandbox" in p
        for p in said
    )
    assert any(
        p.startswith("environments.3:") and "needs `type`: one of reasoning_gym, trl_env, openenv" in p for p in said
    )
    assert len(said) == 5, said

    cfg = load_config(
        None,
        [
            "environments=[{type: trl_env, factory: 'm:E'}, {type: openenv, url: 'http://h:1', name: g}]",
            "rollout.tools={format: hermes, python: false}",
        ],
    )
    assert [type(e) for e in cfg.environments] == [TrlEnvironment, OpenEnvEnvironment]
    assert [e.label for e in cfg.environments] == ["E", "g"] and all(e.ACTS_ON_ROWS for e in cfg.environments)
    assert "size" not in cfg.environments[0].model_dump()  # only its own options
    assert Config.model_validate(cfg.model_dump(mode="json")) == cfg
    own = load_config(None, [f"environments=[{ARITH}}}]"]).environments[0]
    assert isinstance(own, ReasoningGymEnvironment) and not own.ACTS_ON_ROWS and own.label == "basic_arithmetic"
    names = {name for name, _, _ in describe_options()}
    assert {"environments[type=reasoning_gym].dataset", "environments[type=trl_env].trusted"} <= names
    assert "environments[type=openenv].connect_timeout_s" in names and "environments[type=trl_env].size" not in names
