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


def test_inflight_weights_reach_bf16_autocast_decoding(tiny_model_path):
    """bf16 rollouts under autocast over fp32 weights (a GPU without copies, a CPU without bf16
    packing): weights changed in place between tokens are what the next tokens are sampled from,
    as when the parameters are replaced by new tensors. autocast's cache of casts would otherwise
    keep multiplying old weights until the call ends."""
    from plait.models import load_model, load_tokenizer
    from plait.rollout.hf import HFEngine

    tok, model = load_tokenizer(str(tiny_model_path)), load_model(str(tiny_model_path))
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = [Prompt(0, "", tok("What is 2 + 2?")["input_ids"])]
    head = model.get_output_embeddings()  # tied to the input embeddings: a new tensor would untie it
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    old = [m.weight for m in linears]
    gen = torch.Generator().manual_seed(0)
    new = [torch.randn(w.shape, generator=gen) * 0.5 for w in old]

    def run(swap_at: int | None, in_place: bool = True):
        engine = HFEngine(model, tok, precision="bf16", packed_weights=False)
        calls = {"n": 0}
        kept = [w.detach().clone() for w in old]

        def hook():  # the prefill's call, then one before each decoding step
            calls["n"] += 1
            if calls["n"] == swap_at:
                with torch.no_grad():
                    for m, w in zip(linears, new):
                        if in_place:  # as a weight receiver writes
                            m.weight.copy_(w)
                        else:
                            m.weight = torch.nn.Parameter(w.clone())
            return int(swap_at is not None and calls["n"] >= swap_at)

        engine.on_token = hook
        try:
            c = engine.generate(prompt, params)[0][0]
            return c.token_ids, c.logprobs
        finally:
            with torch.no_grad():
                for m, w, k in zip(linears, old, kept):
                    w.copy_(k)
                    m.weight = w

    before, in_place, replaced = run(None), run(4), run(4, in_place=False)
    assert in_place == replaced  # tokens and log-probs
    assert in_place[0][:3] == before[0][:3] and in_place[0][3:] != before[0][3:]


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
