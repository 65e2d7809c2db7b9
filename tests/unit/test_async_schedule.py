"""The pieces of asynchronous generation that need no process: the version schedule, and the
HF generation process's in-flight weight swap between tokens."""

import torch

from plait.rollout.hf_process import HFReplica, completion_dict
from plait.rollout.vllm_engine import to_completion
from plait.train.rollouts import scheduled_version, staleness
from plait.types import Completion, Group, Prompt, SamplingParams


def test_round_t_is_generated_with_the_weights_after_round_t_minus_1_minus_k():
    assert [scheduled_version(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]  # synchronous
    assert [scheduled_version(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [scheduled_version(t, 3) for t in range(1, 8)] == [0, 0, 0, 0, 1, 2, 3]
    # trained at version t-1: never more than k behind
    for k in range(4):
        assert all(0 <= (t - 1) - scheduled_version(t, k) <= k for t in range(1, 20))


def test_staleness_counts_every_token_version():
    c1 = Completion(0, [1, 2], "", [0.0, 0.0], False, "eos", weight_version=3)
    c2 = Completion(0, [1, 2, 3], "", [0.0] * 3, False, "eos", weight_version=2, token_versions=[2, 3, 3])
    assert staleness([Group(Prompt(0, "", [1]), [c1, c2])], 4) == [1, 2, 1, 1]


def test_inflight_weights_are_swapped_in_between_tokens(tiny_model_path):
    replica = HFReplica(
        dict(engine="hf", model=str(tiny_model_path), precision="fp32", batch_size=8, packed_weights=True)
        | dict(inflight=True, device="cpu")
    )
    replica._load()
    model = replica.engine.model
    new = {n: torch.randn_like(p) * 0.02 for n, p in model.named_parameters()}
    calls, real = {"n": 0}, replica._current_version

    def hook():  # new weights arrive while the third decoding step is about to run
        calls["n"] += 1
        if calls["n"] == 3:
            replica.pending = (7, new)
        return real()

    replica.engine.on_token = hook
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=0)
    groups = replica.engine.generate([Prompt(0, "", [1, 2, 3])], params, n=2)
    for c in groups[0]:
        assert c.token_versions == [0, 0, 7, 7, 7, 7][: len(c.token_ids)] and c.weight_version == 0
        back = to_completion(Prompt(0, "", [1, 2, 3]), completion_dict(c), 0)
        assert back.token_versions == c.token_versions and back.finish_reason == c.finish_reason
    assert replica.version == 7 and replica.pending is None
    assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())
