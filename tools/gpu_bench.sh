#!/usr/bin/env bash
# `anchor bench` on a GPU machine without network, on SmolLM2's shape with random weights (no weights file to copy):
#   here:  python tools/gpu_kit.py pack --model default --out .devkit/smollm2
#          pip download the wheels the machine lacks into .whl (typer, gguf, zstandard, deepspeed and
#          its pydantic/hjson, transformers at the project's pin)
#   there: bash tools/gpu_bench.sh OUT   (carry .whl and .devkit)
# Results: OUT/tests.log (the CUDA-marked tests; TESTS=none skips them, TESTS=PATHS narrows them),
# OUT/varlen (anchor bench: torch's varlen attention, 16K-64K, and whole training steps at 64K), OUT/flex
# (the flex engine, attention alone). Copied back, they are kept as results/gpu/bench_<gpu>*.
set -o pipefail
OUT=${1:?usage: gpu_bench.sh OUT}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -f .devkit/smollm2/model.safetensors ] || python3 tools/gpu_kit.py weights .devkit/smollm2 || exit 1
if [ "$TESTS" != none ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda ${TESTS:-tests} -s 2>&1 | tee "$OUT/tests.log" \
    | grep -E "rel L2|grad rel|losses|passed|failed|Error|assert" | tail -40
fi
bench() { timeout "$1" python3 -m anchor bench --model .devkit/smollm2 --seq-len 16k,32k,64k \
  --variants full,intra_doc,anchor --distributions corpus,slimpajama,long_upsampled --windows 2 --repeats 3 \
  --no-progress "${@:2}" 2>&1 | grep -v "^| Llama"; }
bench 300 --engines varlen --step-seq-len 65536 --step-variants intra_doc,anchor --step-steps 4 --out "$OUT/varlen" \
  | tee "$OUT/varlen.log" | tail -45
bench 200 --engines flex --no-step --seq-len 16k,64k --distributions corpus --windows 1 --out "$OUT/flex" \
  | tee "$OUT/flex.log" | grep -E "^\| flex|wrote|Error" | tail -30
