import math
import threading

import pytest

from plait.rewards import BUILTIN, resolve_reward
from plait.rewards.math import accuracy, boxed_accuracy, last_boxed
from plait.rewards.runner import BoundReward, RewardError, score_groups
from plait.types import Completion, Group, Prompt


def test_accuracy_edge_cases():
    texts = [
        "",
        "no answer here",
        "\\boxed{8",
        "$\\frac{1}{$",
        "23 + 58 = 81",
        "so \\boxed{81}.",
        "\\boxed{81.0}",
        "\\boxed{80}",
    ]
    got = accuracy(texts, answer=["81"] * len(texts))
    assert got == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def test_a_number_as_the_reference_answer_is_read_as_its_text():
    """A JSON file's `"answer": 19` reaches the rewards as the int 19."""
    assert accuracy(["\\boxed{19}", "19", "\\boxed{18}"], answer=[19, 19, 19]) == [1.0, 1.0, 0.0]
    assert boxed_accuracy(["\\boxed{2.5}"], answer=[2.5]) == [1.0]


def test_an_unevaluated_expression_is_not_a_numeric_answer():
    """Seen in a real run: the policy learned to answer 'What is 4 + 9?' with \\boxed{4 + 9},
    which math-verify evaluates to 13. A numeric reference needs a numeric answer."""
    texts = ["\\boxed{4 + 9}", "the answer is 4+9", "\\boxed{13}", "\\boxed{13 }", "\\boxed{\\frac{26}{2}}"]
    assert accuracy(texts, answer=["13"] * 5) == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert boxed_accuracy(texts, answer=["13"] * 5) == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert accuracy(["\\boxed{1,000}", "\\boxed{-3.5}"], answer=["1000", "-3.5"]) == [1.0, 1.0]


def test_accuracy_reads_the_last_box_as_boxed_accuracy_does():
    """A completion that boxes several candidates is judged by the one it ends on, by both
    rewards (math-verify alone takes the first box: 'boxed 80, then 81' would score 0 there and
    'boxed 81, then 80' would earn the partial credit for a wrong final answer)."""
    texts = [
        "\\boxed{80} no wait \\boxed{81}",
        "\\boxed{81} no wait \\boxed{80}",
        "\\boxed{ } so 81",
        "\\boxed{81} + 1 = 82",
    ]
    assert accuracy(texts, answer=["81"] * 4) == [1.0, 0.0, 1.0, 1.0]
    assert boxed_accuracy(texts, answer=["81"] * 4) == [1.0, 0.0, 0.0, 1.0]  # an empty box is no box


def test_accuracy_latex_answers():
    assert accuracy(["\\boxed{\\frac{1}{2}}", "0.5", "\\boxed{2}"], answer=["\\frac12", "1/2", "\\sqrt{4}"]) == [
        1.0,
        1.0,
        1.0,
    ]
    assert accuracy(["\\boxed{3}"], answer=[None]) == [0.0]


def test_boxed_accuracy_is_strict():
    texts = ["23 + 58 = 81", "\\boxed{81}", "\\boxed{80} no wait \\boxed{81}", "\\boxed{}", "\\boxed{81"]
    assert boxed_accuracy(texts, answer=["81"] * 5) == [0.0, 1.0, 1.0, 0.0, 0.0]


def test_boxed_format_when_solved_pays_only_where_some_answer_to_the_prompt_is_right():
    """Two prompts' completions: the first prompt has a right answer among them, so its boxed
    completions (the wrong one too) are paid; the second has none, so boxing a wrong answer
    there earns nothing and the group carries no push toward it."""
    texts = ["\\boxed{81}", "\\boxed{80}", "81", "\\boxed{12}", "\\boxed{13}", "11"]
    prompts = ["What is 23 + 58?"] * 3 + ["What is 5 + 9?"] * 3
    answers = ["81"] * 3 + ["14"] * 3
    fmt = BUILTIN["boxed_format"]
    assert fmt(texts) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert fmt(texts, when_solved=True, answer=answers, prompts=prompts) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # an unboxed right answer solves its prompt too: the box is then paid where it appears
    assert fmt(["14", "\\boxed{13}"], when_solved=True, answer=["14"] * 2, prompts=["q"] * 2) == [0.0, 1.0]
    with pytest.raises(ValueError, match="reference answers"):
        fmt(texts, when_solved=True, answer=[None] * 6, prompts=prompts)


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{2}") == "2"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("nothing") is None


def test_format_and_length_rewards():
    assert BUILTIN["boxed_format"](["\\boxed{3}", "\\boxed{ }", "3", ""]) == [1.0, 0.0, 0.0, 0.0]
    assert BUILTIN["think_format"](["<think>a</think><answer>b</answer>", "<answer>b</answer>", ""]) == [1.0, 0.0, 0.0]
    assert BUILTIN["length_penalty"](["", "x"], completion_ids=[[], [1] * 128], max_tokens=256) == [0.0, -0.5]


def test_accuracy_works_outside_the_main_thread():
    """math-verify's signal-based timeouts only work in the main thread; plait turns them off there."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(accuracy, ["\\boxed{81}"], answer=["81"]).result() == [1.0]


def _groups():
    p = Prompt(7, "What is 1 + 1?", [1, 2], "2", {"level": 1})
    cs = [Completion(7, [3], t, [0.0], False, "eos") for t in ("\\boxed{2}", "3")]
    return [Group(p, cs)]


def test_runner_scores_weights_and_passes_columns():
    seen = {}

    def spy(completions, prompts, answer, completion_ids, level, **_):
        seen.update(prompts=prompts, answer=answer, level=level, ids=completion_ids)
        return [0.5, None]

    groups = _groups()
    score_groups(groups, [BoundReward("accuracy", accuracy, 2.0), BoundReward("spy", spy, 1.0)])
    assert groups[0].rewards == {"accuracy": [1.0, 0.0], "spy": [0.5, None]}
    assert groups[0].total == [2.5, 0.0]  # None adds nothing
    assert seen == {"prompts": ["What is 1 + 1?"] * 2, "answer": ["2", "2"], "level": [1, 1], "ids": [[3], [3]]}


def test_a_reward_that_edits_its_inputs_changes_nothing_another_reward_reads():
    """The rewards run at once on threads of their own: the reader waits for the vandal's edits,
    so an edit that leaked would be what it reads (each edit writes other text than was there)."""
    edited = threading.Event()
    seen = {}

    def vandal(completions, answer, level, **_):
        completions[0] = "\\boxed{5}"
        completions[1] = "\\boxed{2}"
        completions.append("extra")
        answer[:] = ["3"] * len(answer)
        level[0] = 99
        edited.set()
        return [0.0] * 2

    def reader(completions, answer, level, **_):
        assert edited.wait(timeout=60), "the vandal never ran"
        seen.update(completions=list(completions), answer=list(answer), level=list(level))
        return accuracy(completions, answer=answer)

    groups = _groups()
    score_groups(groups, [BoundReward("vandal", vandal), BoundReward("reader", reader)])
    assert seen == {"completions": ["\\boxed{2}", "3"], "answer": ["2", "2"], "level": [1, 1]}
    assert groups[0].rewards["reader"] == [1.0, 0.0]  # the texts and answers as generated
    assert [c.text for c in groups[0].completions] == ["\\boxed{2}", "3"]
    assert groups[0].prompt.answer == "2" and groups[0].prompt.columns == {"level": 1}


def test_a_reward_that_scores_nothing_is_warned_about_once_a_run(caplog):
    """Once per bound reward (a run binds its rewards once), not once per process: a second run
    in the same process (a test suite, a notebook) is told again."""

    def nothing(completions, **_):
        return [None] * len(completions)

    def said():
        return [r.getMessage() for r in caplog.records if "'nothing' returned None for all 2" in r.getMessage()]

    bound = [BoundReward("nothing", nothing), BoundReward("accuracy", accuracy)]
    for _ in range(2):
        score_groups(_groups(), bound)
    assert len(said()) == 1 and "return 0.0 for a wrong answer" in said()[0]
    assert not [r for r in caplog.records if "'accuracy'" in r.getMessage()]
    score_groups(_groups(), [BoundReward("nothing", nothing)])  # another run's binding
    assert len(said()) == 2


def test_a_reward_stuck_past_its_timeout_does_not_keep_the_process_from_exiting(tmp_path):
    """A reward on a thread is left to finish when it times out; the process must still end
    once its work is done (a pool's threads are joined at exit: the run printed its last line
    and then hung)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import asyncio, threading
        from plait.rewards.runner import BoundReward, call_rewards, RewardInputs

        async def stuck(completions, **_):
            await asyncio.sleep(10**6)

        inputs = RewardInputs(texts=["a", "b"], kwargs={})
        out, report = call_rewards([BoundReward("stuck", stuck, timeout_s=0.2)], inputs)
        assert out == {"stuck": [None, None]} and report.timeouts == {"stuck": 1}, (out, report)
        print("scored", flush=True)
        """
    )
    # the bound is for the hang only: the script itself needs a second or two
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "scored" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda completions, **_: 1 / 0, "reward 'bad' raised ZeroDivisionError"),
        (lambda completions, **_: [1.0], "returned 1 values for 2 completions"),
        (lambda completions, **_: [1.0, math.nan], "returned nan for completion 1 '3'"),
        (lambda completions, **_: [-math.inf, 0.0], "returned -inf for completion 0 .*: rewards must be finite"),
        (lambda completions, **_: [1.0, "yes"], "returned 'yes' for completion 1"),
        (lambda completions, **_: 3.0, "returned float, expected a list"),
    ],
)
def test_runner_names_function_and_sample(fn, message):
    with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
        score_groups(_groups(), [BoundReward("bad", fn)])


def test_a_raising_reward_is_told_which_columns_were_none():
    """A row without the answer field gives the reward answer=None; when the reward then raises,
    the error says so, because that (not the completion) is the usual cause."""
    p = Prompt(3, "What is 1 + 1?", [1, 2], None, {"level": None})
    groups = [*_groups(), Group(p, [Completion(3, [3], "2", [0.0], False, "eos")])]

    def strict(completions, answer, **_):
        return [float(a in c) for c, a in zip(completions, answer)]

    with pytest.raises(RewardError, match="answer is None for 1 of them, level is None for 1 of them: their rows"):
        score_groups(groups, [BoundReward("strict", strict)])
    with pytest.raises(RewardError) as err:  # every column filled in: no such note
        score_groups(_groups(), [BoundReward("bad", lambda completions, **_: 1 / 0)])
    assert "None" not in str(err.value)


def test_a_reward_without_kwargs_gets_the_columns_it_names_and_a_missing_one_is_named():
    """TRL's rewards take **kwargs; a plain `def f(completions, answer)` works too (it is given
    only what it names, its config kwargs always), and a parameter no column fills is named."""
    seen = []

    def named(completions, answer, scale=1.0):
        seen.append((answer, scale))
        return [scale * (a in c) for c, a in zip(completions, answer)]

    groups = _groups()
    score_groups(groups, [BoundReward("named", named, kwargs={"scale": 0.5})])
    assert groups[0].rewards == {"named": [0.5, 0.0]} and seen == [(["2", "2"], 0.5)]

    def wants_solution(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"takes 'solution', which is not passed: plait passes completions, .*level"):
        score_groups(_groups(), [BoundReward("wants", wants_solution)])


def test_check_names_reward_parameters_and_kwargs_that_do_not_match(tmp_path, monkeypatch, capsys):
    from plait.cli import main

    source = "def f(completions, answer, scale=1.0):\n    return [scale] * len(completions)\n"
    (tmp_path / "my_rewards.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    base = ["check", "--set", "eval.before=false"]
    assert main([*base, "--set", "rewards=[{name: my_rewards:f, kwargs: {scale: 2.0}}]"]) == 0
    assert main([*base, "--set", "rewards=[{name: my_rewards:f, kwargs: {scael: 2.0}}]"]) == 2
    assert "'my_rewards:f' takes no parameter 'scael' (its kwargs in the config)" in capsys.readouterr().err

    # a parameter no column of the data fills: named by `plait check`, before any model loads
    (tmp_path / "more.py").write_text("def g(completions, solution):\n    return [0.0] * len(completions)\n")
    (tmp_path / "train.jsonl").write_text('{"q": "What is 1 + 1?", "answer": "2", "level": 1}\n')
    data = ["--set", "data.path=train.jsonl", "--set", "data.prompt_field=q", "--set", "eval.after=false"]
    assert main([*base, *data, "--set", "rewards=[{name: more:g}]"]) == 2
    err = capsys.readouterr().err
    assert "rewards: 'more:g' takes 'solution', which no column of data.path has (its columns: answer, level;" in err
    assert main([*base, *data, "--set", "rewards=[{name: more:g, kwargs: {solution: x}}]"]) == 0  # its own kwarg
    # with **kwargs too (TRL's shape) a parameter it names must still be filled
    (tmp_path / "kw.py").write_text("def h(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n")
    assert main([*base, *data, "--set", "rewards=[{name: kw:h}]"]) == 2
    assert "rewards: 'kw:h' takes 'solution', which no column of data.path has" in capsys.readouterr().err


def test_a_reward_file_that_fails_to_import_is_named_with_its_line(tmp_path, monkeypatch, capsys):
    from plait.cli import main

    (tmp_path / "syntax.py").write_text("def f(completions, **kw)\n    return [0.0] * len(completions)\n")
    (tmp_path / "raises.py").write_text("KEY = open('no_such_key.txt').read()\ndef f(completions, **kw): ...\n")
    monkeypatch.chdir(tmp_path)
    for name, said in [("syntax", "SyntaxError: expected ':'"), ("raises", "FileNotFoundError: [Errno 2]")]:
        assert main(["check", "--set", f"rewards=[{{name: {tmp_path / name}.py:f}}]"]) == 2
        err = capsys.readouterr().err
        assert f"importing {tmp_path / name}.py failed: {said}" in err and f"{name}.py, line 1)" in err, err
        assert "Traceback" not in err


def test_resolve_reward():
    assert resolve_reward("accuracy") is accuracy
    assert resolve_reward("plait.rewards.math:boxed_accuracy") is boxed_accuracy
    with pytest.raises(KeyError, match="Did you mean 'accuracy'"):
        resolve_reward("acuracy")
    with pytest.raises(KeyError, match="could not be imported"):
        resolve_reward("no_such_module:fn")
    with pytest.raises(
        KeyError, match=r"plait.rewards.math has no function 'boxed_acuracy' \(did you mean 'boxed_accuracy'"
    ):
        resolve_reward("plait.rewards.math:boxed_acuracy")


def test_a_reward_module_in_the_current_directory_is_found(tmp_path, monkeypatch):
    """`plait train` (a console script, so no '' on sys.path) finds a rewards file next to the config."""
    import sys

    (tmp_path / "my_project_rewards.py").write_text(
        "def shout(completions, **_):\n    return [float(t.isupper()) for t in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve_reward("my_project_rewards:shout")(["A", "b"]) == [1.0, 0.0]
    assert sys.path[-1] == str(tmp_path)  # searched last: it never shadows an installed package


def test_soft_overlong_punishment_by_hand():
    fn = BUILTIN["soft_overlong_punishment"]
    # max 20, cache 8: free up to 12 tokens, then linear to -1 at 20, -1 beyond
    ids = [[0] * n for n in (0, 12, 13, 16, 20, 21)]
    assert fn([""] * 6, completion_ids=ids, max_length=20, cache=8) == [0.0, 0.0, -1 / 8, -4 / 8, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache"):
        fn([""], completion_ids=[[]], max_length=4, cache=8)
