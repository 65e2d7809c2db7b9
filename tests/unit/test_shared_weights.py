"""SharedWeights: the /dev/shm file through which the HF generation process gets its weights."""

import io
import multiprocessing
import os

import pytest
import torch

from plait.rollout.weights import SHARED_ALIGN, SharedWeights, metas_of, shared_layout


def _weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(scale))
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g) * scale),
        ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("q:lora_scaling", torch.tensor([0.5 * scale], dtype=torch.float64)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(11, 3, generator=g) * scale),
    ]


def _read_in_another_process(path: str, metas, queue) -> None:
    buffer = io.BytesIO()  # as bytes: a tensor put on a queue would be shared, not copied
    torch.save([t.clone() for t in SharedWeights(path).views(metas)], buffer)
    queue.put(buffer.getvalue())


def test_layout_aligns_every_tensor():
    offsets, total = shared_layout(metas_of(_weights(1.0)))
    assert all(o % SHARED_ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    assert total == offsets[-1] + 11 * 3 * 4


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_push_is_read_bit_for_bit_by_another_process_and_a_larger_one_grows_the_file(tmp_path):
    path = f"/dev/shm/plait-weights-test-{tmp_path.name}"
    writer = SharedWeights(path)
    try:
        ctx = multiprocessing.get_context("spawn")
        for scale, extra in ((1.0, []), (3.0, [("big", torch.randn(4096))])):  # the second push needs more room
            weights = _weights(scale) + extra
            metas = writer.write(weights)
            queue = ctx.Queue()
            reader = ctx.Process(target=_read_in_another_process, args=(path, metas, queue))
            reader.start()
            seen = torch.load(io.BytesIO(queue.get(timeout=120)))
            reader.join(120)
            assert reader.exitcode == 0
            assert all(torch.equal(a, t) and a.dtype == t.dtype for a, (_, t) in zip(seen, weights))
            assert os.stat(path).st_mode & 0o777 == 0o600  # the run's weights: this user's alone
        with pytest.raises(ValueError, match="fewer than"):  # a reader never grows the file
            SharedWeights(path).views(metas_of([("huge", torch.empty(10**6))]))
    finally:
        writer.close()
    assert not os.path.exists(path)


def test_a_generation_process_started_without_a_file_refuses_a_shared_push():
    """Only the process its trainer started with a file reads one: a shared push to any other
    (a `plait rollout-server` replica, say) is refused, which the HTTP layer answers with a 400."""
    import asyncio

    from plait.rollout.hf_process import HFReplica

    replica = HFReplica({"model": "unused", "device": "cpu"})  # the model loads later, at start-up
    with pytest.raises(ValueError, match="started without a shared-memory file"):
        asyncio.run(replica.receive([["model.norm.weight", "float32", [3]]], [[0]], 1, shared=True))
