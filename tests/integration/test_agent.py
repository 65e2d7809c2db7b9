"""Any agent as the rollout (`rollout.agent`, plait/programs/agent.py and endpoint.py, agents in
tests/helpers/agents.py) on the tiny model: the OpenAI-compatible endpoint answers the `openai`
client and plain HTTP with the tokens plait's engine sampled; linked calls become one training
sequence of exactly the sampled tokens, with what the agent added masked; a call that continues
nothing forks; failures are infrastructure errors; hostile requests are refused; and a real run
trains through it and resumes exactly."""

from __future__ import annotations

import agents
import pytest
import test_rollout_func
from test_train import assert_resumed_exactly, crash_then_resume, tiny_overrides

from plait.config import load_config
from plait.config.checks import check_user_loops, probe
from plait.programs import ProgramSetup, make_program
from plait.train.loop import train
from plait.types import SamplingParams


engine_and_prompts = test_rollout_func.engine_and_prompts  # the fixture: the tiny model's engine and two prompts


def agent_program(cfg, tok, fn, **options):
    """The rollout program of a run whose rollout.agent runs agents:`fn`."""
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.agent = {"function": fn if ":" in fn else f"agents:{fn}", **options}
    return make_program(ProgramSetup(cfg, tok))


@pytest.fixture
def run_agent(engine_and_prompts):
    """Run agent `fn` on the two prompts, two rollouts each: (completions by rollout, prompts, tokenizer)."""
    cfg, tok, engine, prompts = engine_and_prompts
    opened = []

    def run(fn, max_tokens=30, **options):
        agents.SEEN.clear()
        hooked = agent_program(cfg, tok, fn, **options)
        opened.append(hooked)
        out = hooked.run(engine, prompts, SamplingParams(max_tokens=max_tokens, seed=5), 2)
        return [c for row in out for c in row], prompts, tok

    yield run
    for hooked in opened:
        hooked.endpoint.close()


def test_chat_calls_are_linked_by_their_tokens_and_what_the_agent_added_is_masked(run_agent):
    """Through the openai client: each rollout's two calls form one sequence, the first reply's
    tokens as sampled (never re-tokenized from the text the client sent back), then the template's
    markup and the agent's user turn (env_mask 0), then the second reply; the log-probs and token
    ids the client got are the ones trained on."""
    completions, prompts, tok = run_agent("chat_twice")
    for k, c in enumerate(completions):
        first, second = (r["choices"][0] for r in agents.SEEN[k])
        a, b = first["token_ids"], second["token_ids"]
        assert c.token_ids[: len(a)] == a and c.token_ids[len(c.token_ids) - len(b) :] == b
        added = c.token_ids[len(a) : len(c.token_ids) - len(b)]
        assert agents.FEEDBACK in tok.decode(added)
        assert c.sampled_mask == [1] * len(a) + [0] * len(added) + [1] * len(b)
        shown = [x["logprob"] for x in first["logprobs"]["content"] + second["logprobs"]["content"]]
        assert [x for x, m in zip(c.logprobs, c.sampled_mask) if m] == shown
        assert c.prompt_ids is None  # the agent sent the row's own prompt: the group's prompt tokens
        assert c.info == {
            "agent/calls": 2.0,
            "agent/forks": 0.0,
            "agent/forked_calls": 0.0,
            "agent/errors": 0.0,
            "agent/calls_out_of_budget": 0.0,
        }
        assert c.env_error is None and c.env_reward is None
        assert c.messages[-2] == {"role": "user", "content": agents.FEEDBACK}
    streams = {tuple(c.token_ids) for c in completions}
    assert len(streams) == len(completions)  # every rollout samples from its own stream


def test_a_reply_that_re_tokenizes_differently_is_continued_from_its_sampled_tokens(engine_and_prompts):
    """The model sampled ' hel' + 'lo', which the tokenizer would read back as ' hello': the next
    call's input goes on from the sampled pair, and only the agent's turn is tokenized."""
    from plait.programs.agent import Recording, _plain
    from plait.programs.template import ChatTurns

    cfg, tok, engine, prompts = engine_and_prompts
    sampled = tok.convert_tokens_to_ids(["Ġhel", "lo"])
    assert tok(tok.decode(sampled), add_special_tokens=False)["input_ids"] != sampled
    rec, turns = Recording(prompts[0], 0, "key", 100), ChatTurns(tok)
    first = [{"role": "user", "content": "Say hello."}]
    sample, ids = rec.link("chat", {"messages": first}, tok, turns, 256)
    assert ids == tok(turns.render([_plain(m) for m in first], True), add_special_tokens=False)["input_ids"]
    sample.take_reply(sampled, [-1.0, -2.0], tok.decode(sampled))  # what the engine answered (AgentProgram._generate)
    reply = {"role": "assistant", "content": sample.turn_text}
    sample.seen = [*first, reply]
    again = [*first, reply, {"role": "user", "content": "Again."}]
    linked, ids = rec.link("chat", {"messages": again}, tok, turns, 256)
    assert linked is sample and ids[len(sample.prompt_ids) : len(sample.prompt_ids) + 2] == sampled
    assert sample.sampled[:2] == [1, 1] and not any(sample.sampled[2:])
    assert tok.decode(ids) == turns.render([_plain(m) for m in again], True)  # the same text, other tokens
    assert ids != tok(tok.decode(ids), add_special_tokens=False)["input_ids"]


def test_a_tool_call_comes_back_as_tool_calls_and_the_tool_turn_links(engine_and_prompts):
    """A reply with a <tool_call> block (the chat template's own format) is returned as OpenAI
    tool_calls; the agent sends it back as the openai client does (arguments as a JSON string)
    with the tool's answer, and the call continues the same sample."""
    from plait.programs.agent import AgentProgram, Call, Recording
    from plait.programs.endpoint import Endpoint
    from plait.programs.template import ChatTurns

    cfg, tok, engine, prompts = engine_and_prompts
    turns = ChatTurns(tok)
    hooked = AgentProgram(tok, None, "test", 60.0, 256, turns, Endpoint())
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    first = {"messages": [{"role": "user", "content": "Add 2 and 3."}], "tools": tools}
    rec = Recording(prompts[0], 0, "key", 200)
    sample, _ = rec.link("chat", first, tok, turns, 256)
    raw = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = tok(raw, add_special_tokens=False)["input_ids"]
    sample.take_reply(ids, [0.0] * len(ids), raw)
    rec.calls = 1
    reply = hooked._reply(Call(rec, "chat", first, None), sample, ids, [0.0] * len(ids), "stop", raw, [])
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    sent_back = {"role": "assistant", "content": "Let me add.", "tool_calls": [call]}
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    again = {"messages": [*first["messages"], sent_back, answer], "tools": tools}
    linked, ids_again = rec.link("chat", again, tok, turns, 256)
    assert linked is sample and ids_again[len(sample.prompt_ids) :][: len(ids)] == ids
    assert "5" in tok.decode(ids_again[len(sample.prompt_ids) + len(ids) :])
    changed = {
        "messages": [
            *first["messages"],
            {**sent_back, "tool_calls": [{**call, "function": {"name": "add", "arguments": "{}"}}]},
            answer,
        ],
        "tools": tools,
    }
    forked, _ = rec.link("chat", changed, tok, turns, 256)
    assert forked is not sample  # other arguments than the model wrote: a fork


def test_text_completions_link_by_text_and_by_token_ids_and_return_the_reward(run_agent):
    completions, prompts, tok = run_agent("text_twice")
    for k, c in enumerate(completions):
        first, second = (r["choices"][0] for r in agents.SEEN[k])
        a, b = first["token_ids"], second["token_ids"]
        assert c.token_ids[: len(a)] == a and c.token_ids[len(c.token_ids) - len(b) :] == b
        assert c.sampled_mask.count(0) == len(c.token_ids) - len(a) - len(b) > 0
        assert first["logprobs"]["token_logprobs"] == c.logprobs[: len(a)]
        assert c.env_reward == len(first["text"] + second["text"]) / 10
        assert c.text.startswith(first["text"]) and "\nAgain:" in c.text


def test_an_agent_may_return_columns_for_the_reward_functions(run_agent):
    """A dict: its `reward` is the rollout's, every other key a column the rewards get by name."""
    from plait.rewards.runner import reward_inputs
    from plait.types import Group

    completions, prompts, _ = run_agent("text_with_columns")
    for k, c in enumerate(completions):
        first, second = (r["choices"][0] for r in agents.SEEN[k])
        chars = len(first["text"] + second["text"])
        assert c.env_reward == chars / 10 and c.columns == {"chars": chars, "index": k}
    groups = [Group(p, completions[2 * i : 2 * i + 2]) for i, p in enumerate(prompts)]
    assert reward_inputs(groups).kwargs["index"] == [0, 1, 2, 3]
    failed, _, _ = run_agent("returns_a_list")  # anything else is the agent's error, said with the fix
    assert all("return a number (the rollout's reward), None, or a dict" in c.env_error for c in failed)


def test_a_call_cut_by_max_tokens_continues_where_it_stopped(run_agent):
    """The second prompt is the first and its reply, nothing added: one sample, every token sampled."""
    completions, _, _ = run_agent("text_continued")
    for k, c in enumerate(completions):
        first, second = (r["choices"][0] for r in agents.SEEN[k])
        assert first["finish_reason"] == "length"
        assert c.token_ids == first["token_ids"] + second["token_ids"] and all(c.sampled_mask)
        assert c.info["agent/forks"] == 0.0


def test_token_id_prompts_link_exactly(engine_and_prompts, run_agent):
    cfg, tok, engine, prompts = engine_and_prompts
    for p in prompts:
        p.columns["prompt_ids"] = list(p.token_ids)
    try:
        completions, _, _ = run_agent("ids_twice")
    finally:
        for p in prompts:
            del p.columns["prompt_ids"]
    for k, c in enumerate(completions):
        first, second = (r["choices"][0] for r in agents.SEEN[k])
        assert c.token_ids == first["token_ids"] + [198, 198, 198] + second["token_ids"]
        assert c.sampled_mask == [1] * len(first["token_ids"]) + [0] * 3 + [1] * len(second["token_ids"])


def test_a_call_that_continues_nothing_forks_and_the_last_sample_is_trained(run_agent):
    completions, prompts, tok = run_agent("forking")
    for k, c in enumerate(completions):
        assert c.info == {
            "agent/calls": 2.0,
            "agent/forks": 1.0,
            "agent/forked_calls": 1.0,
            "agent/errors": 0.0,
            "agent/calls_out_of_budget": 0.0,
        }
        assert c.prompt_ids is not None and "Answer in one word." in tok.decode(c.prompt_ids)
        assert c.prompt_ids != prompts[k // 2].token_ids
        assert all(c.sampled_mask)


def test_the_token_budget_ends_a_rollout_with_finish_reason_length(run_agent):
    completions, prompts, tok = run_agent("chat_twice", max_tokens=7)
    for k, c in enumerate(completions):
        first, second = (r["choices"][0] for r in agents.SEEN[k])
        assert len(c.token_ids) == 7 and c.truncated and c.finish_reason == "length"
        assert second["finish_reason"] == "length"


def test_a_call_the_budget_leaves_nothing_for_is_said_once_and_counted(run_agent, caplog):
    """chat_twice at 7 tokens: the first reply (5) and the agent's turn spend the budget, so every
    second call gets nothing. One warning names the setting and the fix; each rollout counts it."""
    completions, _, _ = run_agent("chat_twice", max_tokens=7)
    said = [r.getMessage() for r in caplog.records if "got no tokens" in r.getMessage()]
    assert len(said) == 1
    assert "rollout.max_completion_length=7 is the whole rollout's budget" in said[0]
    assert "Raise rollout.max_completion_length" in said[0] and "agents:chat_twice" in said[0]
    assert [c.info["agent/calls_out_of_budget"] for c in completions] == [1.0] * 4


def test_rewards_read_the_replies_alone_and_get_the_whole_conversation(run_agent):
    """The agent asks for "\\boxed{7}" between two replies. The text rewards read is the two
    replies (a line break between them), so neither the format reward nor the answer reads the
    agent's words, which the transcript keeps; the conversation the rewards and samples.jsonl get
    holds both replies and the agent's turn, in order (it used to keep the last reply only)."""
    from dataclasses import replace

    from plait.rewards.runner import bind_metric, call_reward, reward_inputs
    from plait.train.metrics import sample_record
    from plait.types import Group

    completions, prompts, _ = run_agent("asks_for_a_box")
    replies = [agents.SEEN[k] for k in range(4)]
    assert not any("boxed" in r for pair in replies for r in pair)  # the tiny model never writes one
    groups = [Group(replace(p, answer="7"), completions[2 * i : 2 * i + 2]) for i, p in enumerate(prompts)]
    inputs = reward_inputs(groups)
    assert inputs.texts == ["\n".join(r for r in pair if r) for pair in replies]
    assert all(agents.ASK_FOR_A_BOX in t for t in inputs.kwargs["transcript"])
    assert call_reward(bind_metric("boxed_format"), inputs) == [0.0] * 4
    assert call_reward(bind_metric("accuracy"), inputs) == [0.0] * 4
    # what they read before: the agent's box, as every reply's format and answer
    transcript = bind_metric("accuracy")
    transcript.kwargs = {"read": "transcript"}
    assert call_reward(transcript, inputs) == [1.0] * 4
    for c, (first, second) in zip(completions, replies):
        assert [(m["role"], m["content"]) for m in c.messages] == [
            ("assistant", first),
            ("user", agents.ASK_FOR_A_BOX),
            ("assistant", second),
        ]
    record = sample_record(1, groups[0])
    assert record["conversation"] == completions[0].messages and record["scored_text"] == inputs.texts[0]


def test_an_async_agents_clients_are_closed_on_its_own_loop(run_agent, caplog):
    """An `async def` agent leaves its `task.async_client()` open: plait closes it on the agent's
    loop. Left open, the garbage collector closed it on another loop, whose task failed with
    "Event loop is closed" ("Task exception was never retrieved" in the run's log)."""
    import asyncio
    import gc

    completions, _, _ = run_agent("async_twice")
    assert all(c.env_error is None and c.info["agent/calls"] == 2.0 for c in completions)
    assert all(agents.SEEN[k][0].is_closed() for k in range(4))
    agents.SEEN.clear()

    async def collect_on_a_running_loop():  # as the endpoint's own loop may, at any time
        gc.collect()
        await asyncio.sleep(0.2)

    asyncio.run(collect_on_a_running_loop())
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage() or r.exc_info]


@pytest.mark.parametrize(
    "fn, error",
    [("raising", "raised RuntimeError: the agent's own bug"), ("silent", "made no call to its endpoint")],
)
def test_a_failing_agent_is_an_infrastructure_error(run_agent, fn, error):
    completions, _, _ = run_agent(fn)
    assert all(error in c.env_error and c.env_reward is None for c in completions)
    assert all(c.info["agent/errors"] == 1.0 for c in completions)


def test_an_agent_past_its_timeout_is_an_error_and_the_round_goes_on(run_agent):
    agents.RELEASE.clear()
    try:
        completions, _, _ = run_agent("hanging", timeout_s=3)
    finally:
        agents.RELEASE.set()
    assert "ran past rollout.agent.timeout_s=3" in completions[0].env_error
    assert all(c.env_error is None for c in completions[1:])
    assert [c.env_reward for c in completions[1:]] == [0.5, 0.5, 0.5]


def test_hostile_requests_are_refused_with_their_reason(run_agent):
    completions, _, _ = run_agent("hostile")
    for k, c in enumerate(completions):
        statuses, body = agents.SEEN[k]
        assert statuses == {
            "no_token": 401,
            "wrong_token": 401,
            "unknown_rollout": 404,
            "n_2": 400,
            "no_messages": 400,
            "bad_prompt": 400,
            "too_long": 400,
            "not_json": 400,
            "good": 200,
        }
        assert "'n' must be 1" in body["error"]["message"]
        assert c.info["agent/calls"] == 1.0 and c.env_error is None


def test_the_shipped_example_agent_runs(run_agent, monkeypatch):
    """configs/agent-selfcheck.yaml's agent (examples/selfcheck_user_loops.py), found from the repository's
    root as `plait train` finds it: every rollout calls, none fails, and a second call continues the
    first."""
    from pathlib import Path

    root = Path(__file__).parents[2]
    monkeypatch.chdir(root)
    cfg = load_config(str(root / "configs" / "agent-selfcheck.yaml"), [])
    assert check_user_loops(cfg, probe(cfg)) == []
    completions, _, _ = run_agent(cfg.rollout.agent.function, max_tokens=64)
    assert all(c.env_error is None and c.info["agent/forks"] == 0 for c in completions)
    for c in completions:  # a second call adds the user turn, masked, to the same sample
        assert c.info["agent/calls"] in (1.0, 2.0) and (0 in c.sampled_mask) == (c.info["agent/calls"] == 2.0)


def test_plait_check_names_a_missing_agent_and_a_loop_beside_it(tiny_model_path, prompts_jsonl, tmp_path):
    sets = tiny_overrides(tiny_model_path, prompts_jsonl, tmp_path, "rollout.agent={function: 'agents:nope'}")
    cfg = load_config(None, sets)
    problems = check_user_loops(cfg, probe(cfg))
    assert "has no function 'nope'" in problems[0]
    sets = tiny_overrides(
        tiny_model_path, prompts_jsonl, tmp_path, "rollout.agent={function: 'agents:chat_twice'}", "rollout.tools={}"
    )
    cfg = load_config(None, sets)
    problems = check_user_loops(cfg, probe(cfg))
    assert problems and "can't run beside it" in problems[0]


def test_a_missing_agent_function_is_called_one_with_the_nearest_names(tiny_model_path, prompts_jsonl, tmp_path):
    sets = tiny_overrides(tiny_model_path, prompts_jsonl, tmp_path, "rollout.agent={function: 'agents:chat_twcie'}")
    (problem,) = check_user_loops(load_config(None, sets), probe(load_config(None, sets)))
    assert "agent function 'agents:chat_twcie': module 'agents' has no function 'chat_twcie'" in problem
    assert "did you mean 'chat_twice'" in problem and "tool function" not in problem


def test_plait_check_notes_an_agent_whose_calls_ask_for_the_whole_budget(tiny_model_path, prompts_jsonl, capsys):
    """chat_twice asks for 5 + 5 tokens in its source: at a budget of 10 the turn it adds between
    them leaves the second call short, which `plait check` says; at 64 it says nothing."""
    from plait.cli import main

    def check(budget: int) -> str:
        sets = tiny_overrides(
            tiny_model_path,
            prompts_jsonl,
            "/unused",
            "rollout.agent={function: 'agents:chat_twice'}",
            f"rollout.max_completion_length={budget}",
        )
        assert main(["check", *sum((["--set", o] for o in sets), [])]) == 0
        return capsys.readouterr().out

    said = check(10)
    assert "agents:chat_twice's calls ask for 5 + 5 = 10 tokens" in said
    assert "rollout.max_completion_length=10 is the whole rollout's budget" in said
    assert "calls ask for" not in check(64)


def test_a_failing_agent_stops_the_run_named_and_says_no_checkpoint_was_written(
    tiny_model_path, prompts_jsonl, tmp_path, caplog, capsys
):
    """Every rollout of round 1 raises: the warning names the agent (it said "environment None"
    when the `environment` reward scored them), and the stop, before any checkpoint, says a
    resume starts over (it said resume=auto continues from the last checkpoint)."""
    from plait.cli import main
    from plait.config.schema import AgentConfig
    from plait.programs.environments import agent_error_problem

    sets = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        tmp_path / "run",
        "rollout.agent={function: 'agents:raising'}",
        "rewards=[{name: environment}]",
        "checkpoint.save_steps=1",
    )
    assert main(["train", *sum((["--set", o] for o in sets), [])]) == 2
    logged = [r.getMessage() for r in caplog.records]
    assert any("agent agents:raising failed on 8 of 8 rollouts" in m for m in logged)
    assert not any("environment None" in m for m in logged)
    err = capsys.readouterr().err
    assert "fix the agent agents:raising; no checkpoint was written before it stopped" in err
    assert "the agent's own bug" in err  # the round's own error, quoted in the stop message
    assert "resume=auto would start the run over from round 1" in err and "last checkpoint" not in err
    metrics = {"agent/errors": 8.0, "agent/rollouts": 8.0}
    later = agent_error_problem(AgentConfig(function="agents:raising"), metrics, 3, saved=2)
    assert "resume=auto continues from the last checkpoint (round 2)" in later


def test_the_report_draws_the_agent_metrics():
    from plait.report import make_figures

    history = [
        {"round": r, "agent/rollouts": 8.0, "agent/calls": 16.0, "agent/calls_per_rollout": 2.0, "agent/forks": 0.0}
        | {"agent/forked_calls": 0.0, "agent/errors": 1.0, "agent/error_share": 0.125, "agent/calls_out_of_budget": 3.0}
        for r in (1, 2)
    ]
    (agent,) = [f for f in make_figures(history, [], "accuracy") if f.name == "agent"]
    assert agent.png[:8] == b"\x89PNG\r\n\x1a\n" and "agent/calls_out_of_budget" in agent.title


def test_a_run_trains_through_an_agent_and_resumes_exactly(tiny_model_path, prompts_jsonl, tmp_path):
    """Four rounds through chat_twice straight, and the same run crashed in round 3 and resumed:
    the same weights bit for bit and the same sampled tokens each round (the lockstep batches
    make the agents' calls reproducible); the agent metrics are logged."""
    agent = "rollout.agent={function: 'agents:chat_twice'}"
    straight, crashed, result = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path, agent)
    assert_resumed_exactly(straight, crashed)
    m = result.history[-1]
    assert m["agent/calls_per_rollout"] == 2.0 and m["agent/errors"] == 0.0 and m["agent/rollouts"] == 8.0


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_a_run_trains_on_the_agents_tokens_with_the_engines_logprobs(
    tiny_model_path, prompts_jsonl, tmp_path, staleness
):
    """Synchronous, and asynchronous (k = 1: the endpoint serves from rank 0's producer thread and
    its calls reach the generation process); the agent's reward is the `environment` reward; the
    log-probs the endpoint returned are the trainer's own where both hold the same weights."""
    sets = tiny_overrides(
        tiny_model_path,
        prompts_jsonl,
        tmp_path / "run",
        "rollout.agent={function: 'agents:text_twice'}",
        "rollout.max_completion_length=24",
        "rewards=[{name: environment}]",
        "train.max_steps=2",
        f"rollout.max_staleness={staleness}",
    )
    result = train(load_config(None, sets))
    assert len(result.history) == 2
    for m in result.history:
        assert m["agent/calls_per_rollout"] == 2.0 and m["agent/errors"] == 0.0
        assert m["reward/environment/mean"] > 0  # what text_twice returned: the characters the model wrote
    same_weights = result.history if staleness == 0 else result.history[:1]
    assert all(m["logprob_gap"] < 1e-4 for m in same_weights)


def test_two_training_processes_each_serve_their_own_agents(tiny_model_path, prompts_jsonl, tmp_path, helper_env):
    """Under torchrun, 2 processes: each generates its share through an endpoint of its own; the
    logged counts are the sums over both."""
    import json
    import subprocess

    from test_vllm import train_cmd

    out = tmp_path / "run"
    args = tiny_overrides(
        tiny_model_path, prompts_jsonl, out, "rollout.agent={function: 'agents:chat_twice'}", "train.max_steps=2"
    )
    res = subprocess.run(train_cmd(2, args), env=helper_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["agent/rollouts"] for m in rounds] == [8.0, 8.0]  # 2 prompts x 4 generations per round, both processes
    assert all(m["agent/calls"] == 16.0 for m in rounds)
