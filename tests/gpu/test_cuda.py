"""The CUDA paths, run on a GPU machine: `make test-gpu` (docs/gpu-tests.md).

Skipped where torch sees no GPU. `PLAIT_TEST_DEVICE=cpu make test-gpu` runs the same tests on
the CPU, which checks the tests themselves on a machine without a GPU; the CUDA-only
assertions (CUDA memory telemetry, the datasheet peak) are then skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from test_train import crash_then_resume, final_weights, tiny_overrides

from plait.comm import free_port
from plait.config import load_config
from plait.train.loop import train


DEVICE = os.environ.get("PLAIT_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA GPU here"),
]
CUDA = DEVICE == "cuda"
GPU_ATOL = 1e-5  # a GPU's reductions may differ in order between runs; on CPU the tests ask torch.equal


def on_device(model, data, out, *extra):
    return tiny_overrides(model, data, out, f"train.device={DEVICE}", *extra)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_weights(a: dict, b: dict, exact: bool) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=GPU_ATOL, msg=k)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_run_on_the_device(tiny_model_path, prompts_jsonl, tmp_path, precision):
    """Generation and training on the device: the weights move, every loss is finite, and the
    telemetry has the device's memory and (on a known GPU) its datasheet peak."""
    from safetensors.torch import load_file

    out = tmp_path / precision
    result = train(load_config(None, on_device(tiny_model_path, prompts_jsonl, out, f"train.precision={precision}")))
    m = result.history
    assert len(m) == 4 and all(torch.isfinite(torch.tensor(x["loss"])) for x in m)
    before = load_file(str(tiny_model_path / "model.safetensors"))
    after = final_weights(out)
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in after if k in before)
    if CUDA:
        assert all(x["memory/cuda_peak_allocated_gb"] > 0 for x in m)
        name = torch.cuda.get_device_name()
        from plait.telemetry.flops import gpu_peak

        if gpu_peak(name, precision):  # a GPU in plait's table: MFU against its datasheet
            assert all(0 < x["mfu/step"] < 1 for x in m)


def test_fsdp2_in_one_process_matches_the_local_backend(tiny_model_path, prompts_jsonl, tmp_path, helper_env):
    """One torchrun process with train.backend=fsdp2 samples the local backend's completions in
    every round and ends near its weights: within 2e-5 on CPU (~1e-6 seen), 1e-4 on a GPU. Each
    runs as its own `plait train`, on a GPU with train.deterministic (which pins cuBLAS's workspace
    before CUDA starts). The two still differ in the last bits: the sharded module's forward and
    backward round otherwise than the plain one (their loss hashes part in round 1), and Adam
    turns a last-bit difference in a near-zero gradient into a step of up to the learning rate
    (1e-3 here). On an H200 (2026-11-28) the weights ended 2.01e-5 apart, the completions equal."""
    from plait.diff import first_hash_parting, hashes_by_round

    runs = {}
    for backend in ("local", "fsdp2"):
        runs[backend] = tmp_path / backend
        sets = [f"train.backend={backend}", *(["train.deterministic=true"] if CUDA else [])]
        flags = sum((["--set", s] for s in on_device(tiny_model_path, prompts_jsonl, runs[backend], *sets)), [])
        cmd = [sys.executable]
        if backend == "fsdp2":
            cmd += ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1"]
            cmd += ["--master_port", str(free_port())]
        proc = subprocess.run(
            [*cmd, "-m", "plait", "train", *flags], env=helper_env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    parting = first_hash_parting(hashes_by_round(runs["local"]), hashes_by_round(runs["fsdp2"]))
    a, b = final_weights(runs["local"]), final_weights(runs["fsdp2"])
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    where = f"the runs part at round {parting.round}, stage {parting.stage}"
    assert parting.completions_compared == 4 and parting.completions_part is None, where
    assert worst <= (1e-4 if CUDA else 2e-5), f"max |local - fsdp2| = {worst:.2e}; {where}"


def test_a_run_resumed_on_the_device_ends_with_the_unbroken_run_s_weights(tiny_model_path, prompts_jsonl, tmp_path):
    straight, crashed, resumed = crash_then_resume(tiny_model_path, prompts_jsonl, tmp_path, f"train.device={DEVICE}")
    assert len(resumed.history) == 2  # rounds 3 and 4
    same_weights(final_weights(straight), final_weights(crashed), exact=not CUDA)
    assert [x["loss"] for x in metrics(crashed)][:2] == [x["loss"] for x in metrics(straight)][:2]


@pytest.mark.skipif(not CUDA, reason="the datasheet tables are for GPUs")
def test_this_gpu_is_in_the_datasheet_tables():
    from plait.telemetry.bandwidth import gpu_bandwidth
    from plait.telemetry.flops import device_peak

    name = torch.cuda.get_device_name()
    peak, source = device_peak(torch.device("cuda"), "bf16")
    assert peak and "datasheet" in source, f"{name}: add it to GPU_PEAKS"
    assert gpu_bandwidth(name), f"{name}: add it to GPU_BANDWIDTH"


@pytest.mark.skipif(not CUDA or importlib.util.find_spec("vllm") is None, reason="needs vLLM on a GPU")
def test_colocated_vllm_on_the_gpu(vllm_model, prompts_jsonl, tmp_path):
    out = tmp_path / "vllm"
    result = train(load_config(None, on_device(vllm_model, prompts_jsonl, out, "rollout.engine=vllm")))
    assert all(x["logprob_gap"] < 1e-2 for x in result.history)


def _generation_setup(tiny_model_path):
    from plait.models import load_model, load_tokenizer
    from plait.types import Prompt

    tok = load_tokenizer(str(tiny_model_path))
    model = load_model(str(tiny_model_path)).to(DEVICE)
    texts = ["What is 2 + 2?", "Name a colour, please, and say why you like it.", "Hi"]
    return model, tok, [Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(texts)]


def _tokens_and_logprobs(groups):
    return [[c.token_ids for c in g] for g in groups], torch.tensor([x for g in groups for c in g for x in c.logprobs])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphed_decoding_samples_what_eager_decoding_does(tiny_model_path, precision):
    """rollout/graphs.py on the GPU: replays of the captured step give the uncaptured static
    step's log-probs (1e-5) and tokens, and, in fp32, eager decoding's tokens (greedy and
    sampled, same seed) and log-probs within 1e-4; in bf16, the weights' bf16 copies
    (Bf16Copies) give what autocast's own casts give; the capture is counted and timed."""
    from plait.rollout.graphs import StaticDecoder
    from plait.rollout.hf import HFEngine
    from plait.types import SamplingParams

    model, tok, prompts = _generation_setup(tiny_model_path)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=7)
        graphed = HFEngine(model, tok, precision=precision)
        uncaptured = HFEngine(model, tok, precision=precision)
        uncaptured.static = StaticDecoder(capture=False)
        eager = HFEngine(model, tok, precision=precision, cuda_graphs=False)
        for e in (graphed, uncaptured, eager):
            e.eos_ids = list(range(0, len(tok), 9))  # rows finish at different steps
        g_tok, g_lp = _tokens_and_logprobs(graphed.generate(prompts, params, n=4))
        u_tok, u_lp = _tokens_and_logprobs(uncaptured.generate(prompts, params, n=4))
        assert g_tok == u_tok and torch.allclose(g_lp, u_lp, atol=1e-5), (g_lp - u_lp).abs().max()
        stats = graphed.stats()
        assert stats["rollout/graph_captures"] == 1 and stats["rollout/graph_capture_s"] > 0
        again = _tokens_and_logprobs(graphed.generate(prompts, params, n=4))
        assert again[0] == g_tok and graphed.stats()["rollout/graph_captures"] == 0  # replayed, not recaptured
        if precision == "fp32":
            e_tok, e_lp = _tokens_and_logprobs(eager.generate(prompts, params, n=4))
            assert g_tok == e_tok and torch.allclose(g_lp, e_lp, atol=1e-4), (g_lp - e_lp).abs().max()
        else:
            autocast_only = HFEngine(model, tok, precision=precision, packed_weights=False)
            autocast_only.eos_ids = graphed.eos_ids
            a_tok, a_lp = _tokens_and_logprobs(autocast_only.generate(prompts, params, n=4))
            assert len(graphed.copies.copies) > 0 and not autocast_only.copies.copies
            assert g_tok == a_tok and torch.allclose(g_lp, a_lp, atol=1e-6), (g_lp - a_lp).abs().max()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphs_sample_from_updated_weights_and_recapture_replaced_ones(tiny_model_path, precision):
    """A graph samples from weights updated in place (in bf16: its bf16 copies follow them) and
    is captured again for replaced ones; compared with decoding that reads the module afresh
    (fp32: eager; bf16: graphed under autocast's own casts, the same arithmetic)."""
    from plait.rollout.hf import HFEngine
    from plait.types import SamplingParams

    model, tok, prompts = _generation_setup(tiny_model_path)
    params = SamplingParams(max_tokens=12, temperature=0, seed=1)
    graphed = HFEngine(model, tok, precision=precision)
    if precision == "fp32":
        eager = HFEngine(model, tok, cuda_graphs=False)
    else:
        eager = HFEngine(model, tok, precision=precision, packed_weights=False)
    before = graphed.generate(prompts, params, n=2)
    graphed.stats()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # in place, as the optimizer does
    moved = _tokens_and_logprobs(graphed.generate(prompts, params, n=2))[0]
    assert moved == _tokens_and_logprobs(eager.generate(prompts, params, n=2))[0]
    assert moved != _tokens_and_logprobs(before)[0] and graphed.stats()["rollout/graph_captures"] == 0
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach() * -1.0)  # a new tensor: the graph must not read the old
    replaced = _tokens_and_logprobs(graphed.generate(prompts, params, n=2))[0]
    assert replaced == _tokens_and_logprobs(eager.generate(prompts, params, n=2))[0]
    assert graphed.stats()["rollout/graph_captures"] == 1
