import os
import sys
from pathlib import Path

import pytest


HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "helpers"))  # reward functions importable as `plait_test_rewards:...`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# train.precision=auto is bf16 on a CPU with bf16 units: the suite's tests of exact sampling
# (engine log-probs within 1e-5 of the trainer's) and of runs split over processes (the tokens one
# process samples) are about fp32, on every CPU kind CI may get. The tests of auto itself unset it.
os.environ.setdefault("PLAIT_AUTO_PRECISION", "fp32")
# The AVX2 pass compiles into a kernel cache of its own, as `plait` does (plait.train.determinism)
from plait.train.determinism import separate_kernel_cache  # noqa: E402


separate_kernel_cache()
# On pytest-xdist workers, each worker's share of the cores: torch in the worker and in every
# process a test starts (inheriting it) runs that many threads, not one per core. Two workers
# that each ran two OpenMP threads on two cores kept their threads waiting at every parallel
# region for one the other worker had preempted (docs/testing.md). A run's own train.threads and
# rollout.generator_threads still set theirs.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))


# The numeric tests (losses, advantages, rewards, log-probs, the engines' sampling, resume
# exactness): `make test` runs them a second time with the kernels capped to AVX2 on a CPU that
# has more, so that a tolerance or an equality that holds on one CPU kind only fails before it
# lands. A file name, or file::test for a part of a file.
NUMERIC = {
    "unit/test_losses.py",
    "unit/test_advantages.py",
    "unit/test_variants.py",
    "unit/test_rewards.py",
    "unit/test_rewards_library.py",
    "unit/test_cpu_fast_paths.py",
    "unit/test_flops_and_timing.py",
    "unit/test_async_schedule.py",
    "unit/test_optim.py",
    "unit/test_checkpoint.py",
    "integration/test_rollout_hf.py",
    "integration/test_algorithms.py",
    "integration/test_train.py::test_resume_after_a_crash_is_exact",
    "integration/test_train.py::test_variants_train",
}


# `make test` runs the suite on two pytest-xdist workers, each test a unit of its own handed out
# in the order below. These files start vLLM (some in the test's own process), a Ray cluster, or
# train the real model, and they come last, so no other test follows them on a worker. An
# in-process vLLM engine used to leave its process group and environment behind, which changed
# later in-process runs (test_agent's resumed run sampled other bits after test_vllm.py's colocated
# drift test); its close now undoes both (asserted in that test), but vLLM and torch's compiler
# keep process-wide state nobody can undo (kernel registries, compile caches).
RUN_LAST = {
    "integration/test_vllm.py",
    "integration/test_ray.py",
    "integration/test_setup_and_offline.py",
}

# The longest of those start the last block, longest first: handed out near its end, the 2.4-minute
# server-death test ran on one worker while the other sat idle for 2.2 minutes (docs/testing.md).
LONGEST_LAST = (
    "integration/test_vllm.py::test_server_death_is_reported_and_the_run_resumes",
    "integration/test_setup_and_offline.py::test_the_bundled_model_learns_in_a_few_rounds",
    "integration/test_vllm.py::test_server_mode_two_trainers_share_two_replicas",
)

# The tests of one vLLM server (`shared_server`) and the Ray tests (whose placement test uses that
# server too) go to one worker together, at the start of the last block: handed out one by one, both
# workers started a server and a Ray cluster of their own (a server of the tiny model takes 22-29 s
# to start on a 2-core Zen 4). `pytest_xdist_make_scheduler` below keeps them together.
ONE_WORKER = (
    "integration/test_ray.py::",
    "integration/test_rollout_security.py::test_a_vllm_rollout_server_refuses_hostile_clients_and_its_trainer",
    "integration/test_vllm.py::test_a_vllm_engine_given_corrupted_weights_stops_the_run[server]",
    "integration/test_vllm.py::test_server_mode_generates_asynchronously[full]",
    "integration/test_vllm.py::test_a_teacher_on_a_rollout_server_scores_as_the_held_one",
)


def _on_one_worker(nodeid: str) -> bool:
    """Is this test (its node id, `tests/...`) one of ONE_WORKER's?"""
    return nodeid.removeprefix("tests/").startswith(ONE_WORKER)


# A test of the taught tool model comes first: its worker makes the model (about a minute of CPU,
# once per session: tests/helpers/tool_model.py) while the other worker runs other tests. In
# collection order both workers reached the tool tests together, and one waited for the other's
# model with its core idle. (pytest-xdist's xdist_group cannot pin them to one worker: with
# pytest 9.2 its group suffix no longer reaches the node ids.)
RUN_FIRST = {"integration/test_tools.py::test_a_run_calls_tools_logs_them_and_rewards_see_the_conversation"}


def _where(item) -> str:
    return Path(item.path).relative_to(HERE).as_posix()


def _turn(item) -> tuple[int, int]:
    where = _where(item)
    named = f"{where}::{item.originalname}"
    if named in RUN_FIRST:
        return 0, 0
    if _on_one_worker(f"{where}::{item.name}"):
        return 2, -1
    if where not in RUN_LAST:
        return 1, 0
    return (2, LONGEST_LAST.index(named)) if named in LONGEST_LAST else (3, 0)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: pytest without it runs the suite too
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (make test's), with ONE_WORKER's tests handed out as one unit of work and
    every other test as a unit of its own: pytest-xdist's own way to group tests (xdist_group) no
    longer reaches the node ids under pytest 9.2."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerForTheSharedServer(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "shared vLLM server and Ray" if _on_one_worker(nodeid) else nodeid

    return OneWorkerForTheSharedServer(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_turn)
    for item in items:
        where = _where(item)
        if where in NUMERIC or f"{where}::{item.originalname}" in NUMERIC:
            item.add_marker(pytest.mark.numeric)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A 2-layer random Llama with the bundled model's real tokenizer (about 3.3M params)."""
    from plait.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def teacher_model_path(tmp_path_factory):
    """Another 2-layer random Llama with the same tokenizer: a distillation teacher."""
    from plait.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1)


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """A tiny Llama vLLM's CPU attention supports (head_dim 32), for the vLLM and Ray tests."""
    from plait.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm") / "model", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def prompts_jsonl(tmp_path_factory):
    """Train/eval prompt files in the user-facing JSONL format."""
    import json

    from plait.data.tasks import arithmetic

    d = tmp_path_factory.mktemp("data")
    for split, n in (("train", 64), ("eval", 8)):
        rows = [{"question": r["prompt"], "answer": r["answer"], "a": r["a"]} for r in arithmetic(split, n)]
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "train.jsonl", d / "eval.jsonl"


@pytest.fixture(scope="session")
def helper_env():
    """Environment for subprocesses: the test reward module on PYTHONPATH (read it, don't change it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "helpers"), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="session")
def shared_server(vllm_model, helper_env):
    """One `plait rollout-server` (dp 1, started as a user starts it) per pytest worker, for the
    tests that stop nothing of it and make it hold what they need first (`base_server`): a server
    takes about half a minute to start (31 s on a 2-core Xeon), paid once per worker instead of once
    per test, in test_vllm.py, test_ray.py and test_rollout_security.py alike. Under `make test`
    those tests share one worker (ONE_WORKER above), so one server serves them all."""
    from test_vllm import RolloutServer

    server = RolloutServer(vllm_model, dp=1, env=helper_env)
    yield server
    server.stop()
    # stopped with its process group signalled (as Ctrl-C does), it leaves nothing for the resource tracker
    assert "leaked semaphore" not in server.output()


@pytest.fixture
def base_server(shared_server, vllm_model):
    """The shared server holding the base model's weights (version 0) again, whatever an earlier
    test sent it (a trainer pushes its own weights first, a teacher on the server is read as it is)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.config import load_config
    from plait.models import load_tokenizer
    from plait.rollout import make_engine

    assert shared_server.proc.poll() is None, "an earlier test stopped the shared server"
    sets = ["rollout.engine=vllm", "rollout.vllm.mode=server", f"rollout.vllm.servers=[{shared_server.url}]"]
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    remote = make_engine(load_config(None, [*sets, "train.precision=fp32"]), model, load_tokenizer(vllm_model))
    try:
        remote.weights_for_round(0)
    finally:
        remote.close()
    assert shared_server.health()["version"] == 0
    return shared_server
