"""Reward functions for tests: they vary on a random model's output, so advantages are non-zero."""

CALLS = {"n": 0, "crash_at": None}


def vowel_share(completions, **_):
    """Share of vowels in the completion text: varied for random text."""
    return [sum(ch in "aeiouAEIOU" for ch in t) / max(1, len(t)) for t in completions]


def _crash_in_round(kwargs) -> None:
    """Raise in round CALLS['crash_at'] (1-based; from `trainer_state`, so however many reward
    calls a round makes: dynamic sampling and two-stage rounds make several)."""
    state = kwargs.get("trainer_state")
    if CALLS["crash_at"] is not None and state is not None and state.global_step + 1 >= CALLS["crash_at"]:
        raise RuntimeError("simulated crash")


def vowel_share_crashing(completions, **kwargs):
    """vowel_share, but raises in round CALLS['crash_at'] (simulates a crash mid-run)."""
    _crash_in_round(kwargs)
    return vowel_share(completions, **kwargs)


def vowel_share_crash_env(completions, **kwargs):
    """vowel_share, but the process whose RANK is $PLAIT_TEST_CRASH_RANK raises on its call
    number $PLAIT_TEST_CRASH_CALL (a crash in one process of a torchrun job)."""
    import os

    CALLS["n"] += 1
    at = os.environ.get("PLAIT_TEST_CRASH_CALL")
    if at and CALLS["n"] >= int(at) and os.environ.get("RANK", "0") == os.environ.get("PLAIT_TEST_CRASH_RANK", "0"):
        raise RuntimeError("simulated crash")
    return vowel_share(completions, **kwargs)


def vowel_share_kill_env(completions, **kwargs):
    """vowel_share, but in round $PLAIT_TEST_KILL_ROUND (from `trainer_state`, however many reward
    calls a round makes) it SIGKILLs (or sends $PLAIT_TEST_KILL_SIGNAL to) process group
    $PLAIT_TEST_KILL_PGID, or process $PLAIT_TEST_KILL_PID, once: a rollout server, or its engine
    alone, dying or hanging mid-run. With $PLAIT_TEST_KILL_AWAIT set to a process id, the round
    goes on only once that process has exited (a replica that must notice its engine's death by
    itself, with no request in flight)."""
    import os
    import signal

    state = kwargs.get("trainer_state")
    at = os.environ.get("PLAIT_TEST_KILL_ROUND")
    if at and state is not None and state.global_step + 1 == int(at) and not CALLS.get("killed"):
        CALLS["killed"] = True
        sig = signal.Signals[os.environ.get("PLAIT_TEST_KILL_SIGNAL", "SIGKILL")]
        if "PLAIT_TEST_KILL_PID" in os.environ:
            os.kill(int(os.environ["PLAIT_TEST_KILL_PID"]), sig)
        else:
            os.killpg(int(os.environ["PLAIT_TEST_KILL_PGID"]), sig)
        if "PLAIT_TEST_KILL_AWAIT" in os.environ:
            _await_exit(int(os.environ["PLAIT_TEST_KILL_AWAIT"]), timeout=600)
    return vowel_share(completions, **kwargs)


def _await_exit(pid: int, timeout: float) -> None:
    """Returns once process `pid` is gone (not this process's child: psutil polls for it)."""
    import psutil

    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass


def sometimes_constant(completions, prompts, **_):
    """0 for every completion of prompts with an even length (those groups teach nothing),
    vowel share otherwise: exercises dynamic sampling."""
    shares = vowel_share(completions)
    return [0.0 if len(p) % 2 == 0 else s for p, s in zip(prompts, shares)]


def sometimes_constant_crashing(completions, prompts, **kwargs):
    """sometimes_constant, but raises in round CALLS['crash_at'], as vowel_share_crashing."""
    _crash_in_round(kwargs)
    return sometimes_constant(completions, prompts, **kwargs)


def even_a(completions, a, **_):
    """1.0 for every completion of prompts whose column `a` is even, else 0.0: a group is
    all-correct or all-failed, which is what two-stage generation's rules decide on."""
    return [1.0 if x % 2 == 0 else 0.0 for x in a]


async def async_vowel_share(completions, **kwargs):
    """vowel_share as a coroutine function (async rewards are awaited by the runner)."""
    import asyncio

    await asyncio.sleep(0)
    return vowel_share(completions, **kwargs)


def vowel_share_die_once(completions, **kwargs):
    """vowel_share, but the training process whose RANK is $PLAIT_TEST_DIE_RANK is SIGKILLed on
    its call number $PLAIT_TEST_DIE_CALL, once per marker file $PLAIT_TEST_DIE_MARKER (a trainer
    dying for good, e.g. out of memory; the restarted job must get past that step). The reward
    runs in a process of its own, whose parent is the trainer."""
    import os
    import signal

    CALLS["n"] += 1
    marker = os.environ.get("PLAIT_TEST_DIE_MARKER")
    if (
        marker
        and not os.path.exists(marker)
        and CALLS["n"] == int(os.environ["PLAIT_TEST_DIE_CALL"])
        and os.environ.get("RANK", "0") == os.environ.get("PLAIT_TEST_DIE_RANK", "0")
    ):
        open(marker, "w").close()
        os.kill(os.getppid() if os.environ.get("PLAIT_REWARD_WORKER") else os.getpid(), signal.SIGKILL)
    return vowel_share(completions, **kwargs)


def used_a_tool(completions, **kwargs):
    """1.0 for a multi-turn completion with a tool turn: checks that rewards get the whole
    conversation (a list of messages, assistant and tool turns) for conversational data."""
    for c in completions:
        if not (isinstance(c, list) and c and all({"role", "content"} <= set(m) for m in c)):
            raise TypeError(f"expected a conversation (a list of messages), got {c!r:.200}")
    return [1.0 if any(m["role"] == "tool" for m in c) else 0.0 for c in completions]


def vowel_share_ulp_env(completions, **kwargs):
    """vowel_share, but on call number $PLAIT_TEST_ULP_CALL its first score is one ulp larger (a
    difference smaller than any rounding of the metrics, for `plait diff`'s hashes to find)."""
    import math
    import os

    CALLS["n"] += 1
    scores = vowel_share(completions, **kwargs)
    if os.environ.get("PLAIT_TEST_ULP_CALL") and CALLS["n"] == int(os.environ["PLAIT_TEST_ULP_CALL"]):
        scores[0] = math.nextafter(scores[0], math.inf)
    return scores


def vowel_share_inf_env(completions, **kwargs):
    """vowel_share, but on call number $PLAIT_TEST_INF_CALL the first completion's reward is inf
    (a reward function that overflows mid-run)."""
    import math
    import os

    CALLS["n"] += 1
    scores = vowel_share(completions, **kwargs)
    if CALLS["n"] == int(os.environ.get("PLAIT_TEST_INF_CALL", "0")):
        scores[0] = math.inf
    return scores


def vowel_share_then_less(completions, trainer_state=None, **kwargs):
    """vowel_share plus 2, 4 and 6 in rounds 1, 2 and 3, and nothing after: the mean reward rises
    by 2 a round, then falls by 6 at round 4 and stays down, whatever the policy does (a run for
    recovery to roll back; vowel shares lie in [0, 1], so they cannot change which round is best)."""
    done = trainer_state.global_step if trainer_state is not None else 0
    bonus = 2.0 * (done + 1) if done < 3 else 0.0
    return [v + bonus for v in vowel_share(completions)]


def vowel_share_killing_teacher(completions, **kwargs):
    """vowel_share, but in round CALLS['crash_at'] it SIGKILLs the distillation teacher's own
    process (a child of this one running `plait.train.teacher`): a teacher dying mid-run."""
    import os
    import signal

    import psutil

    state = kwargs.get("trainer_state")
    if CALLS["crash_at"] is not None and state is not None and state.global_step + 1 >= CALLS["crash_at"]:
        for child in psutil.Process().children():
            if "plait.train.teacher" in " ".join(child.cmdline()):
                os.kill(child.pid, signal.SIGKILL)  # not reaped here: the trainer sees its exit code
    return vowel_share(completions, **kwargs)


EVALUATIONS = {"n": 0}
PLANTED_EVALUATIONS = (0.25, 0.75, 0.125)  # before, round 2, after: the last evaluation falls


def evaluations_then_a_fall(completions, prompts, **kwargs):
    """An eval metric whose k-th evaluation pays PLANTED_EVALUATIONS[k] to every completion, and
    0.75 from then on: a run evaluated before, at round 2 and after round 3 sees its last
    evaluation fall from its best, whatever its weights (reset EVALUATIONS first). An evaluation
    is a call with one completion per prompt; a round's accuracy on its groups (several per
    prompt) is not counted."""
    if len(set(prompts)) < len(prompts):
        return [0.0] * len(completions)
    k = EVALUATIONS["n"]
    EVALUATIONS["n"] += 1
    value = PLANTED_EVALUATIONS[k] if k < len(PLANTED_EVALUATIONS) else 0.75
    return [value] * len(completions)
