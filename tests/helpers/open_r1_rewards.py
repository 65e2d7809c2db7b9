"""Open-R1's accuracy reward as source text, for tests that write it into a user's reward file:
conversational completions, the `solution` column, math-verify with its default (signal-based)
timeouts, which only work on a main thread."""

ACCURACY_REWARD = """
from math_verify import LatexExtractionConfig, parse, verify


def open_r1_accuracy(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        gold = parse(sol, extraction_mode="first_match")
        if len(gold) != 0:
            answer = parse(content, extraction_config=[LatexExtractionConfig()], extraction_mode="first_match")
            rewards.append(float(verify(gold, answer)))
        else:
            rewards.append(None)
    return rewards
"""
