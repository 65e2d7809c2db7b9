"""Agents (`rollout.agent`, plait/programs/agent.py) for tests: each drives its rollout through the
OpenAI-compatible endpoint, with the `openai` client or plain HTTP."""

from __future__ import annotations

import threading

import httpx


FEEDBACK = "Check that once more."
SEEN: dict[int, list] = {}  # rollout index -> the replies (or HTTP statuses) its agent got, for the tests to read
RELEASE = threading.Event()  # a hanging agent waits for it


def post(url: str, **kwargs) -> httpx.Response:
    """A call answers when every agent of the round has called: no client timeout a busy machine breaks."""
    return httpx.post(url, timeout=None, **kwargs)


def chat_twice(task):
    """The openai client: the model answers, the agent adds a user turn, the model answers again
    (the second call repeats the first reply as the client returned it)."""
    client = task.client()
    messages = task.messages
    first = client.chat.completions.create(model=task.model, messages=messages, max_tokens=5, logprobs=True)
    reply = first.choices[0].message.model_dump(exclude_none=True)
    messages += [reply, {"role": "user", "content": FEEDBACK}]
    second = client.chat.completions.create(model=task.model, messages=messages, max_tokens=5, logprobs=True)
    SEEN[task.index] = [first.model_dump(), second.model_dump()]


def text_twice(task):
    """Plain HTTP on /v1/completions: the agent appends a line to the text it got and goes on;
    its reward is the number of characters the model wrote, a tenth each."""
    url, auth = f"{task.base_url}/completions", {"Authorization": f"Bearer {task.api_key}"}
    prompt = str(task.prompt)
    first = post(url, json={"model": task.model, "prompt": prompt, "max_tokens": 4, "logprobs": 0}, headers=auth)
    first.raise_for_status()
    text = first.json()["choices"][0]["text"]
    again = prompt + text + "\nAgain:"
    second = post(url, json={"model": task.model, "prompt": again, "max_tokens": 4}, headers=auth)
    second.raise_for_status()
    SEEN[task.index] = [first.json(), second.json()]
    return len(text + second.json()["choices"][0]["text"]) / 10


def ids_twice(task):
    """/v1/completions with token ids: the second prompt is the first's ids, the sampled ids and
    three of the agent's own."""
    url, auth = f"{task.base_url}/completions", {"Authorization": f"Bearer {task.api_key}"}
    ids = task.columns["prompt_ids"]
    first = post(url, json={"model": task.model, "prompt": ids, "max_tokens": 4}, headers=auth).json()
    again = ids + first["choices"][0]["token_ids"] + [198, 198, 198]
    second = post(url, json={"model": task.model, "prompt": again, "max_tokens": 4}, headers=auth).json()
    SEEN[task.index] = [first, second]


def text_with_columns(task):
    """text_twice, returning its reward with two columns for the reward functions."""
    reward = text_twice(task)
    return {"reward": reward, "chars": reward * 10, "index": task.index}


def returns_a_list(task):
    text_twice(task)
    return [1.0]


def forking(task):
    """The second call changes the system prompt: it continues nothing, so it starts a new sample."""
    client = task.client()
    client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
    other = [{"role": "system", "content": "Answer in one word."}, *task.messages]
    client.chat.completions.create(model=task.model, messages=other, max_tokens=4)


def raising(task):
    task.client().chat.completions.create(model=task.model, messages=task.messages, max_tokens=3)
    raise RuntimeError("the agent's own bug")


def silent(task):
    return 1.0


def hanging(task):
    """One call, then it waits far past its timeout (until the test releases it)."""
    if task.index == 0:
        task.client().chat.completions.create(model=task.model, messages=task.messages, max_tokens=3)
        RELEASE.wait()
        return 1.0
    task.client().chat.completions.create(model=task.model, messages=task.messages, max_tokens=3)
    return 0.5


def hostile(task):
    """Requests plait must refuse, each with its status; then one good call."""
    base = task.base_url
    auth = {"Authorization": f"Bearer {task.api_key}"}
    msgs = task.messages
    statuses = {
        "no_token": post(f"{base}/chat/completions", json={"messages": msgs}).status_code,
        "wrong_token": post(
            f"{base}/chat/completions", json={"messages": msgs}, headers={"Authorization": "Bearer nope"}
        ).status_code,
        "unknown_rollout": post(
            base.rsplit("/rollouts/", 1)[0] + "/rollouts/not-a-rollout/v1/chat/completions",
            json={"messages": msgs},
            headers=auth,
        ).status_code,
        "n_2": post(f"{base}/chat/completions", json={"messages": msgs, "n": 2}, headers=auth).status_code,
        "no_messages": post(f"{base}/chat/completions", json={"messages": []}, headers=auth).status_code,
        "bad_prompt": post(f"{base}/completions", json={"prompt": {"x": 1}}, headers=auth).status_code,
        "too_long": post(f"{base}/completions", json={"prompt": "word " * 2000}, headers=auth).status_code,
        "not_json": post(f"{base}/completions", content=b"{", headers=auth).status_code,
    }
    messages = post(f"{base}/chat/completions", json={"messages": msgs, "n": 2}, headers=auth).json()
    good = post(f"{base}/chat/completions", json={"messages": msgs, "max_tokens": 3}, headers=auth)
    statuses["good"] = good.status_code
    SEEN[task.index] = [statuses, messages]


def text_continued(task):
    """/v1/completions cut by max_tokens, then continued from exactly what it returned."""
    url, auth = f"{task.base_url}/completions", {"Authorization": f"Bearer {task.api_key}"}
    prompt = str(task.prompt)
    first = post(url, json={"prompt": prompt, "max_tokens": 3}, headers=auth).json()
    again = prompt + first["choices"][0]["text"]
    second = post(url, json={"prompt": again, "max_tokens": 3}, headers=auth).json()
    SEEN[task.index] = [first, second]


ASK_FOR_A_BOX = "Give the answer as \\boxed{7}."


def asks_for_a_box(task):
    """The model answers, the agent asks for the answer in the format its own words show (and
    name a number), the model answers again: what rewards read must be the replies alone."""
    client = task.client()
    messages = task.messages
    first = client.chat.completions.create(model=task.model, messages=messages, max_tokens=5)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": ASK_FOR_A_BOX}]
    second = client.chat.completions.create(model=task.model, messages=messages, max_tokens=5)
    SEEN[task.index] = [first.choices[0].message.content, second.choices[0].message.content]


async def async_twice(task):
    """`async def`, two linked calls through the async client plait hands out (not closed here)."""
    client = task.async_client()
    messages = task.messages
    first = await client.chat.completions.create(model=task.model, messages=messages, max_tokens=3)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": FEEDBACK}]
    await client.chat.completions.create(model=task.model, messages=messages, max_tokens=3)
    SEEN[task.index] = [client]
    return 1.0
