"""Multi-turn tool use, the parts that need no model and no sandbox: reading calls, and the
check that a chat template renders a conversation by appending its turns."""

import pytest

from plait.programs.calls import Call, ToolRunner, cut, function_schema, hermes_calls, python_call
from plait.programs.template import ChatTurns, TemplateMismatch, check_template
from plait.programs.tools import PROBE_TURNS


def test_a_python_call_is_a_python_block_that_ends_the_turn():
    assert python_call("Let me see.\n```python\nprint(6 * 7)\n```\n") == "print(6 * 7)"
    assert python_call("```py\nx = 1\ny = 2\n```   \n\n") == "x = 1\ny = 2"
    assert python_call("```Python3\nx = 1\n```") == "x = 1"
    assert python_call("```python\nx = 1\n```\nand then I said") is None  # text after it: not a call
    assert python_call("```\nplain fence\n```\n") is None  # no language: not Python
    assert python_call("```bash\nls\n```\n") is None
    assert python_call("```python\nunclosed\n") is None
    assert python_call("no code at all") is None


def test_hermes_calls_are_read_and_a_malformed_one_says_why():
    text = (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    a, b, c = hermes_calls(text)
    assert (a.name, a.arguments, a.problem) == ("multiply", {"a": 6, "b": 7}, None)
    assert (b.name, b.arguments) == ("python", {"code": "print(1)"})  # arguments as a JSON string, as some models write
    assert c.problem is not None and "could not read the tool call" in c.problem


def test_output_is_cut_to_the_limit_saying_so():
    assert cut("x" * 10, 20) == "x" * 10
    assert cut("x" * 50, 20) == "x" * 20 + "\n... (30 more characters cut)"


def _chatml(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _conversation(tok, template=None):
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    kwargs = {"chat_template": template} if template else {}
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return ChatTurns(tok, template), messages, text


def test_the_bundled_chat_template_appends_turns(tiny_model_path):
    turns, messages, text = _conversation(_chatml(tiny_model_path))
    check_template(turns, messages, text, PROBE_TURNS["python"])  # no TemplateMismatch
    check_template(turns, messages, text, PROBE_TURNS["hermes"])
    after = turns.after_turn(messages, text, [{"role": "tool", "content": "42"}])
    assert after == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


# A template that drops earlier turns' reasoning, as Qwen3's does: a conversation rendered
# whole is not its turns appended.
DROPS_REASONING = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A template whose assistant header ends in a space: the model's first word merges with it
# when the conversation is tokenized whole (" So" is one token, " " + "So" two).
SPACE_HEADER = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_place(tiny_model_path):
    turns, messages, text = _conversation(_chatml(tiny_model_path), DROPS_REASONING)
    with pytest.raises(TemplateMismatch, match="before assistant turn 2 differently") as err:
        check_template(turns, messages, text, PROBE_TURNS["python"])
    assert "<think>" in str(err.value)  # where they part: the reasoning the template dropped


def test_a_template_whose_turn_boundary_splits_a_token_is_refused(tiny_model_path):
    turns, messages, text = _conversation(_chatml(tiny_model_path), SPACE_HEADER)
    with pytest.raises(TemplateMismatch, match="a turn boundary falls inside a token"):
        check_template(turns, messages, text, ["So \\boxed{42}."])


def test_check_tools_turns_a_mismatch_into_a_config_error(tiny_model_path):
    from plait.config.load import config_from_dict
    from plait.data import build_prompts, load_rows
    from plait.programs.tools import check_tools

    tok = _chatml(tiny_model_path)
    cfg = config_from_dict({"data": {"task": "multiply", "chat_template": DROPS_REASONING}, "rollout": {"tools": {}}})
    prompts = build_prompts(load_rows(cfg.data, "train")[:2], tok, cfg.data)
    with pytest.raises(ValueError, match="can't be used for multi-turn rollouts.*data.chat_template"):
        check_tools(cfg, tok, prompts)
    cfg.data.chat_template = True
    check_tools(cfg, tok, build_prompts(load_rows(cfg.data, "train")[:2], tok, cfg.data))  # the tokenizer's own passes


def test_function_tools_run_in_process_when_trusted():
    from tool_functions import broken, multiply, slow

    from plait.config.schema import ToolsConfig

    cfg = ToolsConfig(format="hermes", python=False, trusted_functions=True, timeout_s=0.5)
    runner = ToolRunner(cfg, None, {"multiply": multiply, "slow": slow, "broken": broken})
    assert runner.run(Call("multiply", {"a": 6, "b": 7}), []).output == "42"
    wrong = runner.run(Call("multiply", {"a": 6}), [])
    assert wrong.status == "error" and "missing a required argument: 'b'" in wrong.output
    failed = runner.run(Call("broken", {"x": 3}), [])
    assert (failed.status, failed.output) == ("error", "RuntimeError: broken(3)")
    late = runner.run(Call("slow", {"seconds": 30}), [])
    assert late.status == "timeout" and "ran past 0.5s" in late.output
    unknown = runner.run(Call("divide", {}), [])
    assert unknown.status == "error" and "no tool named 'divide' (tools: broken, multiply, slow)" in unknown.output


def test_a_function_schema_comes_from_hints_and_docstring():
    from tool_functions import multiply, undocumented

    schema = function_schema(multiply)
    assert schema["function"]["name"] == "multiply"
    assert schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first factor.",
    }
    with pytest.raises(TypeError, match="needs type hints on every argument"):
        function_schema(undocumented)


def test_config_checks_name_what_tools_need():
    from plait.config import ConfigError, validate
    from plait.config.load import config_from_dict

    cfg = config_from_dict(
        {
            "rollout": {
                "tools": {"python": False, "max_turns": 1, "functions": ["tool_functions:undocumented", "nope:x"]}
            },
            "data": {"chat_template": False},
        }
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = "\n".join(err.value.problems)
    assert "max_turns=1 leaves no turn after a tool call" in text
    assert "set rollout.tools.format=hermes" in text
    assert "needs type hints" in text and "No module named 'nope'" in text


def test_tool_functions_and_environment_factories_load_from_a_file_path(tmp_path, monkeypatch):
    """'path/to/file.py:name' as well as 'module:name' (tools, factories, rollout_func and agents
    all resolve through these two), with the module's source readable for the sandbox."""
    import inspect

    from plait.programs.calls import resolve_factory, resolve_function

    (tmp_path / "my_tools.py").write_text(
        "def double(x: int) -> int:\n    return 2 * x\n\n\n"
        "class Env:\n    def reset(self, **row):\n        return None\n"
    )
    monkeypatch.chdir(tmp_path.parent)
    double = resolve_function(f"./{tmp_path.name}/my_tools.py:double")
    assert double(4) == 8
    assert "return 2 * x" in inspect.getsource(inspect.getmodule(double))
    assert resolve_factory(f"{tmp_path}/my_tools.py:Env")().reset() is None
    assert inspect.getmodule(resolve_factory(f"{tmp_path}/my_tools.py:Env")) is inspect.getmodule(double)  # loaded once
    with pytest.raises(ImportError, match="no file"):
        resolve_function(f"{tmp_path}/nope.py:double")
