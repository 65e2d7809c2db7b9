import json

import pytest

from plait.config import DataConfig
from plait.data import DataError, PromptOrder, build_prompts, data_problems, data_warnings, read_file
from plait.data.tasks import arithmetic


class FakeTokenizer:
    """Whitespace tokenizer with a chat template flag: enough to test field mapping and limits."""

    chat_template = "yes"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}


ROWS = [
    {"question": "What is 2 + 2?", "solution": 4, "level": "easy"},
    {"question": "word " * 50, "solution": 1, "level": "hard"},
]


def test_jsonl_parquet_and_disk_read_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "ds"))
    assert read_file(str(tmp_path / "p.jsonl")) == ROWS
    assert read_file(str(tmp_path / "p.parquet")) == ROWS
    assert read_file(str(tmp_path / "ds"), split="train") == ROWS
    with pytest.raises(DataError, match="has splits \\['train'\\], not 'test'"):
        read_file(str(tmp_path / "ds"), split="test")


def test_bad_jsonl_line_is_named(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        read_file(str(f))
    # a line that is not UTF-8 (Latin-1's é), named with its number by the read and by `plait check`
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    said = "bad.jsonl:2: not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"
    with pytest.raises(DataError, match=said.replace("(", r"\(").replace(")", r"\)")):
        read_file(str(f))
    assert any(said in p for p in data_problems(DataConfig(path=str(f))))
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')  # a byte-order mark is fine
    assert read_file(str(f)) == [{"prompt": "a"}]


def test_field_mapping_chat_template_and_columns():
    cfg = DataConfig(
        task=None,
        path="x",
        prompt_field="question",
        answer_field="solution",
        system_prompt="Be brief.",
        max_prompt_length=30,
    )
    logs = []
    prompts = build_prompts(ROWS, FakeTokenizer(), cfg, log=logs.append)
    assert len(prompts) == 1  # the 50-word prompt is dropped ...
    assert "dropped 1 of 2 prompts" in logs[0]  # ... and counted in the log
    p = prompts[0]
    assert p.text == "<system> Be brief. <user> What is 2 + 2? <assistant>"
    # the answer column reaches rewards as `answer` and under its own name (Open-R1's `solution`)
    assert p.answer == "4" and p.columns == {"level": "easy", "solution": 4}
    from plait.rewards.runner import reward_inputs
    from plait.types import Completion, Group

    kwargs = reward_inputs([Group(p, [Completion(p.index, [1], "x", [0.0], False, "eos")])]).kwargs
    assert kwargs["answer"] == ["4"] and kwargs["solution"] == [4] and kwargs["level"] == ["easy"]


def test_overlong_prompts_can_be_an_error():
    cfg = DataConfig(task=None, path="x", prompt_field="question", max_prompt_length=30, overlong_prompts="error")
    with pytest.raises(DataError, match="longer than data.max_prompt_length=30"):
        build_prompts(ROWS, FakeTokenizer(), cfg)


def test_messages_field_and_missing_field():
    rows = [{"msgs": [{"role": "user", "content": "hi"}], "answer": "x"}]
    cfg = DataConfig(task=None, path="x", messages_field="msgs")
    assert build_prompts(rows, FakeTokenizer(), cfg)[0].text == "<user> hi <assistant>"
    with pytest.raises(DataError, match="row 0 has no field 'prompt'"):
        build_prompts(rows, FakeTokenizer(), DataConfig(task=None, path="x"))


def test_examples_come_before_each_prompt_after_the_system_message():
    shots = [{"prompt": "What is 1 + 1?", "completion": "2"}, {"prompt": "What is 2 + 3?", "completion": "5"}]
    rows = [ROWS[0], {"question": "What is 1 + 1?", "solution": 2}]
    cfg = DataConfig(task=None, path="x", prompt_field="question", system_prompt="Be brief.", examples=shots)
    logs = []
    prompts = build_prompts(rows, FakeTokenizer(), cfg, log=logs.append)
    assert prompts[0].text == (
        "<system> Be brief. <user> What is 1 + 1? <assistant> 2 <user> What is 2 + 3? <assistant> 5 "
        "<user> What is 2 + 2? <assistant>"
    )
    assert prompts[0].messages[-1] == {"role": "user", "content": "What is 2 + 2?"}
    assert prompts[0].source == "What is 2 + 2?"  # a standard prompt reaches rewards as the row's own text
    conversational = build_prompts(rows[:1], FakeTokenizer(), cfg.model_copy(update={"conversational": True}))
    assert conversational[0].source == prompts[0].messages and len(prompts[0].messages) == 6  # as the model saw it
    assert any("1 of 2 prompts are also data.examples (first: row 1)" in line for line in logs)
    # a row's own messages keep their system message first; without a chat template the turns are lines
    cfg = DataConfig(task=None, path="x", messages_field="msgs", examples=shots[:1], chat_template=False)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert build_prompts([{"msgs": msgs}], FakeTokenizer(), cfg)[0].text == "S\nWhat is 1 + 1?\n2\nQ"


def test_the_arithmetic_task_brings_its_own_examples_and_they_can_be_turned_off():
    from plait.data import describe_examples, example_turns
    from plait.data.tasks import ARITHMETIC_EXAMPLES

    default = DataConfig()
    turns = example_turns(default)
    assert [t["role"] for t in turns] == ["user", "assistant"] * len(ARITHMETIC_EXAMPLES)
    problems = {r["prompt"] for r in arithmetic("train", 1000) + arithmetic("eval", 100)}
    for e in ARITHMETIC_EXAMPLES:  # never one of the task's problems (a > 50), and its answer is right
        a, b = (int(x) for x in e["prompt"].split("What is ")[1].split("?")[0].split(" + "))
        assert a > 50 and e["prompt"] not in problems and e["completion"] == f"{a} + {b} = \\boxed{{{a + b}}}"
    assert "2 worked example(s)" in describe_examples(default) and "task arithmetic's own" in describe_examples(default)
    assert example_turns(DataConfig(examples=[])) == [] and describe_examples(DataConfig(examples=[])) is None
    assert example_turns(DataConfig(task="humaneval")) == []  # a task without examples
    assert example_turns(DataConfig(task=None, path="x")) == []  # the user's own data: none unless given
    with pytest.raises(ValueError, match="completion"):
        DataConfig(examples=[{"prompt": "q"}])


def test_plait_tasks_says_which_tasks_bring_examples(capsys):
    from plait.cli import main

    assert main(["tasks"]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "2 worked example(s)" in lines["arithmetic"] and "worked example" not in lines["humaneval"]
    assert "1 worked example(s)" in lines["multiply"]


def test_a_worked_tool_call_shows_the_tools_output_and_the_answer_after_it():
    """An example with tool_output and answer goes on as a tool run does: the call, the tool's
    output in the tools' role, the model's answer. The multiply task brings one: its product is
    right, it is never a task problem, and its code block is what the python tool runs."""
    from plait.data import describe_examples, example_turns
    from plait.data.tasks import MULTIPLY_EXAMPLES, multiply
    from plait.programs.calls import python_call

    turns = example_turns(DataConfig(task="multiply"), tool_role="user")
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    (e,) = MULTIPLY_EXAMPLES
    code = python_call(e["completion"])  # the turn ends at the block, as the model's would
    a, b = (int(x) for x in code.removeprefix("print(").removesuffix(")").split(" * "))
    assert e["tool_output"] == f"{a * b}\n" and e["answer"].endswith(f"\\boxed{{{a * b}}}")
    problems = {r["prompt"] for r in multiply("train", 2000) + multiply("eval", 200)}
    assert a > 9999 and e["prompt"] not in problems
    assert "1 worked example(s)" in describe_examples(DataConfig(task="multiply"))
    shots = [
        {
            "prompt": "What is 6 * 7?",
            "completion": "```python\nprint(6 * 7)\n```",
            "tool_output": "42\n",
            "answer": "\\boxed{42}",
        }
    ]
    cfg = DataConfig(task=None, path="x", prompt_field="question", examples=shots)
    text = build_prompts([{"question": "What is 3 * 3?"}], FakeTokenizer(), cfg, tool_role="tool")[0].text
    assert text == (
        "<user> What is 6 * 7? <assistant> ```python\nprint(6 * 7)\n``` <tool> 42\n <assistant> \\boxed{42} "
        "<user> What is 3 * 3? <assistant>"
    )
    with pytest.raises(ValueError, match="needs both tool_output"):
        DataConfig(examples=[{"prompt": "q", "completion": "c", "tool_output": "42"}])


def test_arithmetic_is_deterministic_correct_and_held_out():
    a, b = arithmetic("train", 500, seed=3), arithmetic("train", 500, seed=3)
    assert a == b
    assert arithmetic("train", 50, seed=4) != a[:50]
    for row in a:
        assert int(row["answer"]) == row["a"] + row["b"]
        assert f"{row['a']} + {row['b']}" in row["prompt"] and "\\boxed{}" in row["prompt"]
    held_out = {r["prompt"] for r in arithmetic("eval", 100, seed=3)}
    assert len(held_out) == 100 and not held_out & {r["prompt"] for r in arithmetic("train", 1000, seed=9)}


def test_prompt_order_is_a_seeded_permutation_per_epoch_and_resumable():
    order = PromptOrder(10, seed=1)
    first = order.take(10)
    assert sorted(first) == list(range(10))
    second = order.take(10)
    assert sorted(second) == list(range(10)) and second != first  # reshuffled each epoch
    resumed = PromptOrder(10, seed=1, consumed=7)
    assert resumed.take(6) == (first + second)[7:13]
    assert PromptOrder(4, seed=0, shuffle=False).take(6) == [0, 1, 2, 3, 0, 1]


def test_processes_read_disjoint_strided_shares_of_the_single_process_order():
    one = PromptOrder(10, seed=1).take(12)
    ranks = [PromptOrder(10, seed=1, rank=r, stride=2) for r in (0, 1)]
    shares = [ranks[0].take(3), ranks[1].take(3)]
    assert sorted(shares[0] + shares[1]) == sorted(one[:6])  # together: the same 6 prompts
    assert shares[0] == one[0:6:2] and shares[1] == one[1:6:2]
    # each process moves on alone (dynamic sampling takes more on one of them)
    assert ranks[0].take(3) == one[6:12:2] and ranks[0].consumed == 6 and ranks[1].consumed == 3


def test_check_reads_the_data_and_reports_every_problem_at_once(tmp_path, capsys):
    from plait.cli import main

    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "a"}\nnot json\n{"q": 1}\n[1]\n')
    empty = tmp_path / "eval.jsonl"
    empty.write_text("")
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": "hi"}\n')
    args = ["check", "--set", f"data.path={train}", "--set", "data.prompt_field=question"]
    assert main([*args, "--set", f"data.eval_path={empty}"]) == 2
    err = capsys.readouterr().err
    assert f"{train}:2: not valid JSON" in err and f"{train}:4: expected a JSON object, got list" in err
    assert "1 of the first 2 rows have no field 'question' (row 1 has ['q'])" in err
    assert f"'{empty}' holds no rows" in err
    cfg = DataConfig(path=str(chat), messages_field="messages")
    assert data_problems(cfg) == [
        "data.path: row 1's 'messages' is not a list of {role, content} messages (1 such rows)"
    ]
    assert data_problems(DataConfig()) == []  # the built-in task: no files to read


def test_prompts_that_are_not_text_are_refused_and_missing_answers_are_told(tmp_path, capsys):
    """A prompt column holding chat messages, a list, null or nothing stops `plait check` and the
    run with the row named (str() of them would train on their repr); rows without the answer
    that others have are told, not refused (a reward may return None for them)."""
    from plait.cli import main

    rows = [
        {"q": "What is 2 + 3?", "answer": "5"},
        {"q": [{"role": "user", "content": "hi"}], "answer": "1"},
        {"q": "   ", "answer": "0"},
        {"q": None},
        {"q": 42},
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(task=None, path=str(train), prompt_field="q")
    assert data_problems(cfg) == [
        "data.path: row 1's 'q' holds chat messages, not text: set data.messages_field=q (3 such rows)"
    ]
    for i, message in [(1, "'q' holds chat messages"), (2, "'q' is empty"), (3, "'q' is null, not text")]:
        with pytest.raises(DataError, match=f"row 0's {message}"):
            build_prompts([rows[i]], FakeTokenizer(), cfg)
    fine = [rows[0], rows[4], {"q": "What is 1 + 1?", "answer": None}]
    prompts = build_prompts(fine, FakeTokenizer(), cfg, log=(said := []).append)
    assert [p.answer for p in prompts] == ["5", None, None] and "<user> 42 <assistant>" in prompts[1].text
    assert said == [
        "2 of 3 rows have no 'answer' (first: row 1): reward functions get answer=None for them and must "
        "handle it (return None for 'not applicable')"
    ]
    train.write_text("".join(json.dumps(r) + "\n" for r in fine))
    args = ["check", "--set", f"data.path={train}", "--set", "data.prompt_field=q", "--set", "eval.before=false"]
    assert main([*args, "--set", "eval.after=false"]) == 0
    assert "data.path: 2 of 3 rows have no 'answer' (first: row 1)" in capsys.readouterr().out
    assert build_prompts(fine[:1], FakeTokenizer(), cfg, log=(said := []).append) and said == []


def test_an_answer_field_no_row_has_is_refused_and_the_default_one_is_told(tmp_path):
    """A column named on purpose that no row holds is refused by name with the row's fields; the
    default 'answer' may be absent from data without answers: told, in check and the run header."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"q": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(3)))
    named = DataConfig(task=None, path=str(train), prompt_field="q", answer_field="answr")
    assert data_problems(named) == [
        "data.path: no row has an answer in 'answr' (row 0 has ['q', 'solution']): reward functions get "
        "answer=None and accuracy scores 0; set data.answer_field to the column with the reference answers, or "
        "data.answer_field=null for data without answers"
    ]
    default = DataConfig(task=None, path=str(train), prompt_field="q")
    assert data_problems(default) == []
    assert data_warnings(default)[0].startswith("data.path: no row has an answer in 'answer' (row 0 has ['q',")
    rows = read_file(str(train))
    build_prompts(rows, FakeTokenizer(), default, log=(said := []).append)
    assert said[0].startswith("no row has an answer in 'answer'")
    assert data_problems(DataConfig(task=None, path=str(train), prompt_field="q", answer_field="solution")) == []
    assert data_warnings(DataConfig(task=None, path=str(train), prompt_field="q", answer_field=None)) == []


def test_rewards_get_trl_s_conventions_for_conversational_and_standard_data():
    """Open-R1's rewards read completion[0]["content"] and the `solution` column; with
    conversational data TRL passes prompts as message lists and completions as assistant
    messages, with standard data both as strings. plait's built-ins always get strings."""
    from plait.rewards.runner import BoundReward, score_groups
    from plait.types import Completion, Group

    seen = {}

    def open_r1_style(completions, solution, prompts, **_):
        seen["prompts"], seen["completions"] = prompts, completions
        return [float(c[0]["content"].strip() == str(s)) for c, s in zip(completions, solution)]

    def plain(completions, prompts, **_):
        seen["plain"] = (prompts, completions)
        return [float(c.strip() == "4") for c in completions]

    chat_rows = [{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "solution": 4}]
    chat = build_prompts(chat_rows, FakeTokenizer(), DataConfig(path="x", messages_field="messages"))
    builtin = BoundReward("boxed_format", lambda completions, **_: [float(isinstance(c, str)) for c in completions])
    builtin.builtin = True
    group = Group(chat[0], [Completion(0, [1], t, [0.0], False, "eos") for t in ("4", " 5")])
    score_groups([group], [BoundReward("openr1", open_r1_style), builtin])
    assert group.rewards == {"openr1": [1.0, 0.0], "boxed_format": [1.0, 1.0]}
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": " 5"}]]
    assert seen["prompts"] == [chat_rows[0]["messages"]] * 2  # the messages, not the templated text

    std = build_prompts(ROWS[:1], FakeTokenizer(), DataConfig(path="x", prompt_field="question"))
    group = Group(std[0], [Completion(0, [1], "4", [0.0], False, "eos")])
    score_groups([group], [BoundReward("plain", plain)])
    assert seen["plain"] == (["What is 2 + 2?"], ["4"]) and group.rewards["plain"] == [1.0]
