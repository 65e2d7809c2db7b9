"""An agent for `rollout.agent` (docs/environments.md): it asks the model, and when the answer
is not boxed, asks once more for the final answer alone. Any OpenAI client code works the same
way; plait trains on the tokens both calls sampled, the second call's user turn masked.

    plait train configs/agent-selfcheck.yaml      # from the repository's root
"""

from __future__ import annotations


ASK_AGAIN = "Give only the final answer, as \\boxed{N}."


def solve(task):
    client = task.client()
    messages = task.messages
    reply = client.chat.completions.create(model=task.model, messages=messages, max_tokens=32)
    choice = reply.choices[0]
    if "\\boxed{" in (choice.message.content or "") or choice.finish_reason == "length":
        return None  # boxed, or the rollout's budget is spent: the reward functions score it
    messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": ASK_AGAIN}]
    client.chat.completions.create(model=task.model, messages=messages, max_tokens=16)
    return None
