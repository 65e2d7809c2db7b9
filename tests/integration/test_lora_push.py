"""LoRA runs whose generation runs in another process (the HF engine's generation process, sync
and async) send it the adapter alone each round; it adds B @ A x scale to its own base copy
and so samples exactly what merged weights would have made it sample."""

import json

import pytest
from test_train import tiny_overrides

from plait.config import load_config
from plait.train.loop import train


pytestmark = pytest.mark.slow


def _run(model, data, out, push: str, staleness: int):
    cfg = load_config(
        None,
        tiny_overrides(
            model,
            data,
            out,
            "model.lora={r: 4}",
            "train.max_steps=3",
            "train.learning_rate=1e-2",
            "rollout.generation_process=true",
            f"rollout.max_staleness={staleness}",
            f"rollout.lora_push={push}",
        ),
    )
    history = train(cfg).history
    hashes = [json.loads(line)["generation"] for line in (out / "hashes.jsonl").read_text().splitlines()]
    return history, hashes


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_adapter_alone_samples_what_merged_weights_sample(tiny_model_path, prompts_jsonl, tmp_path, staleness):
    adapter, adapter_hashes = _run(tiny_model_path, prompts_jsonl, tmp_path / "adapter", "adapter", staleness)
    merged, merged_hashes = _run(tiny_model_path, prompts_jsonl, tmp_path / "merged", "merged", staleness)
    # the same tokens and engine log-probs every round: the engine held the same weights
    assert adapter_hashes == merged_hashes and len(adapter_hashes) == 3
    assert [m["loss"] for m in adapter] == [m["loss"] for m in merged] and any(m["loss"] != 0 for m in adapter)
    pushed = [m for m in adapter if "weight_sync/gb" in m]
    assert pushed and all(m["weight_sync/adapter"] == 1.0 for m in pushed)
    full = [m for m in merged if "weight_sync/gb" in m]
    assert all(m["weight_sync/adapter"] == 0.0 for m in full)
    assert max(m["weight_sync/gb"] for m in pushed) < min(m["weight_sync/gb"] for m in full) / 100
    # and the trainer's log-probs of the samples match the engine's as closely either way
    assert [m["logprob_gap"] for m in adapter] == [m["logprob_gap"] for m in merged]
