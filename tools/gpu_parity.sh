#!/usr/bin/env bash
# The project's GPU checks on a GPU host without network, reached in short jobs (device calls): the real kernels
# against the oracle with SmolLM2's real weights (parity, the torch-stack audit), the CUDA tests, the trainer's
# throughput against a plain transformers loop, and the paper-gpu profile in parts.
# Here, once a checkout, before the first device call (a session's checkout starts without it; under a minute):
#   make gpu-kit    (tools/gpu_kit.py kit: .whl, the wheels the image lacks or holds at another version;
#                   .devkit/parts, the GGUF in two parts sized so calls 2 and 3 leave the tree the same room;
#                   .devkit/heldout.jsonl; .devkit/kit.json, each call's carry below measured with the working
#                   tree, refused over 64 MiB)
# There, the wheels in the first call (every step installs them where /tmp/site is missing):
#   bash tools/gpu_parity.sh OUT start
# then one device call per part while the machine is held (carry .devkit/parts/manifest.json and one
# .devkit/parts/*.part-NNN each):
#   bash tools/gpu_parity.sh OUT join
# then (carry nothing more): bash tools/gpu_parity.sh OUT STEP, STEP one of
#   start    the CUDA tests (`tests`) in the background on cores 12-15, once a session: they need no weights, so
#            they run while the weights travel
#   seed     once per session, before any parity step: the parts an earlier session on this GPU kept
#            (results/gpu/parity/parts_<gpu>.tgz, tracked: `gpu_kit.py keep R` here after the session)
#            unpacked into OUT. Parity runs with --keep-parts, whose keys hold the code, the library versions and
#            the GPU: a carried case is taken only where all are this session's, else computed again
#   smoke    the oracle on JAX's CUDA backend against its CPU one: random:llama, T=97, forward and gradients
#   parity   anchor parity --device cuda at T=$T (1025 by default; 8192): varlen and flex, bf16, the four
#            variants, forward and gradients, the oracle on JAX's CUDA backend (--oracle-device $ORACLE: cuda, or cpu)
#   audit    anchor audit --stack torch on CUDA, each of $ENGINES (varlen flex) at each of $LENGTHS (512 4096), the
#            emulation on --oracle-device $ORACLE (cpu); each audit at most $LIMIT (140) s. At L=512 an engine
#            takes 30-50 s with the CPU oracle; at 4096 the oracle's attention work is 64x, its projections 8x:
#            several minutes an engine on the CPU, so ORACLE=cuda there
#   fanout   the parity cases at T=$T (1025) with the oracle on the CPU, a process per variant on $CORES (3) cores
#            each, in the background (then `wait`, and `merge` joins their reports as OUT/parity_${T}_cpu_oracle)
#   tests    pytest -m cuda, its log (OUT/cuda_tests.log) headed by the commit ($ANCHOR_COMMIT), GPU and versions
#   train    benchmarks/bench_train_gpu.py (alone on the machine: it times steps), $STEPS (22) steps a configuration,
#            the first 2 left out: 20 timed
#   longest  benchmarks/bench_longest_window.py --device cuda: one step per doubling window from $START (65536) up
#            to the plan's longest and the next, each peak (metrics.jsonl) beside the plan's prediction ($OFFLOAD=1:
#            checkpoints offloaded to host memory)
#   phases   where anchor train's steps spend their time (bench_train_gpu.py --phases, each part synchronized,
#            intra_doc/varlen at 16K, 10 steps): to find why a run's last steps can take several times its median
#   paper    `make paper-gpu` in parts, one a session: RUNS=full, then anchor, intra_doc, intra_doc_reset, then
#            intra_doc@fp32,intra_doc_reset@fp32 (HELDOUT=.devkit/heldout.jsonl, carried: the image's Python has
#            no test suite); OUT/paper_<runs>/ joined here by `make paper-gpu-merge PARTS=...`; or
#            PROFILE=paper-gpu-short, the four bf16 runs in one sitting. Needs deepspeed and hjson among the
#            wheels (ZeRO-1)
#   diag     experiments/attn_grad_diag/attn_grad_diag.py: one attention layer's backward on the varlen and flex
#            kernels against fp64 and the emulations (inputs captured here: .devkit/attn_grad_inputs.npz, 10 MB,
#            carried)
#   plan     a 15-minute session's calls 3 and 4 within $BUDGET s each: seed; diag (where its inputs are carried:
#            `gpu_kit.py kit --attention-inputs`, 10 MiB more in call 3); the T=1025 fanout (CPU oracle) on
#            cores 0-11 and, once `start`'s tests have ended, T=8192 with the oracle on CUDA on cores 12-15, side
#            by side, then (8192 done) the audits at L=4096 with the oracle on CUDA; merge. Run again, it
#            continues: a step whose report is written is skipped, a stopped one resumes from its kept cases
#   bg STEP  STEP in the background, outliving the call (the machine stays held while calls follow within 30 s)
#   wait     until the background steps have ended (at most $LIMIT s)
# A session's calls, each begun within 30 s of the last one's end (else the machine goes back, bare, and /tmp
# with it), R=/tmp/res, every call ending with `tar czf $OUT/r.tgz -C /tmp/res .` (what comes back; at most
# 16 MiB a file). With 15 minutes of device time (the wheels alone in call 1, the GGUF in two parts of about
# 47 MiB after them; .devkit/kit.json has each call's MiB with the tree, about 60 at most, and under "commands"
# each call's command and timeout_s as the device tool takes them, the commit filled in), the CUDA tests first:
#   1 (carry .whl; timeout_s 120)       ANCHOR_COMMIT=<the checkout's commit> bash tools/gpu_parity.sh R start
#                                       (the wheels installed, `pytest -m cuda` started in the background on
#                                       cores 12-15: it outlives the call; the commit heads its log, since the
#                                       tree there has no .git)
#   2 AT ONCE (carry manifest, part-000; timeout_s 60)    gpu_parity.sh R join; tar ...
#   3 AT ONCE (carry manifest, part-001; timeout_s 590)
#                                       gpu_parity.sh R join && BUDGET=540 gpu_parity.sh R plan; tar ...
#     (the plan waits for the tests before it gives cores 12-15 to T=8192)
#   4 AT ONCE, not after reading call 3's results (the machine goes back 30 s after a call ends, and a call
#     begun later finds a bare one), carrying nothing, timeout_s = what is left less 20:
#                                       BUDGET=<left less 40> gpu_parity.sh R plan; tar ...
#   after, here: the results unpacked into R, `python tools/gpu_kit.py keep R` (this GPU's parts, for the next
#   session: commit results/gpu/parity/parts_<gpu>.tgz), tools/merge_parity.py (the report) and R/cuda_tests.log
#   kept as results/gpu/cuda_tests_<gpu>.log
# The smoke (the oracle on JAX's CUDA backend, random:llama T=97) is not a step of the plan: T=8192 needs the
# call's time more.
# A paper-gpu session: calls 1 and 2 as above; call 3 (carry manifest, part-001, .devkit/heldout.jsonl; 60 MiB)
# `gpu_parity.sh R join && RUNS=full HELDOUT=.devkit/heldout.jsonl LIMIT=560 gpu_parity.sh R paper`; if it
# stopped at its limit, the same again at once (the demo resumes while the machine is held).
# With 30 minutes, also `train`, `longest` and `phases` (a session after the parity's: the issue's third point).
# The oracle on the CPU at T=8192 (SmolLM2, 2 cores; experiments/oracle_cost): a forward with taps 67 s in
# fp64, 42 s in fa2_bf16 (a variant's forward cases: fp64 and 4 summation orders, ~4 minutes; on the 16 cores
# there, well under one call for the four); one fp64 gradient takes over 15 minutes (memory-bound on
# [heads, T, T] fp64 scores, and a gradient case takes 3 steps in each of 2 policies): gradients at 8192
# need the oracle on CUDA. Its memory there (benchmarks/bench_oracle_grad_memory.py: XLA's plan of the gradient
# program compiled on a CPU, not run; results/memory/oracle_grad_memory_cpu.json): at T=8192 15.7 GiB in
# fp64 and 7.7 in fa2_bf16 or flex_bf16 (1025: 4.5 and 1.8), well inside an H100's 80 beside the torch model;
# each such program takes 20-26 s to compile on a CPU.
# A parity step stopped at its limit keeps the cases it finished (OUT/.parity_$T.parts); the same step in the
# next call computes only the rest.
# The fanout at T=1025 with gradients, 4 cores a variant: about 5 minutes a variant (each gradient case draws the
# emulation in 8 summation orders, parity_tests/grads.py: a bf16 gradient 23 s at T=1025 on 2 cores,
# experiments/grad_baseline/results/grad_draws_cpu_sdpa.json), within one call; at T=8192 with the oracle on
# the CPU no case finishes in a call.
# Device time is counted from the first call to the machine's return, its start included.
# Results under OUT: weights.txt (the joined file's sha256 and the GPU), parity_$T/ (parity_${T}_forward/ with GRADS=), audit_{varlen,flex}_{512,4096}/,
# cuda_tests.log, train_gpu.json, train_phases_gpu.json; each step fits one 10-minute call. Copied back, they are
# kept under results/gpu/ (parity reports in results/gpu/parity/, after tools/merge_parity.py --slim) and
# results/gpu/ (train_gpu_<gpu>.json).
set -o pipefail
OUT=${1:?usage: gpu_parity.sh OUT [start|join|seed|smoke|parity|audit|diag|tests|train|longest|phases|paper|bg STEP|wait|plan]}
STEP=${2:-parity}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
export JAX_DEFAULT_MATMUL_PRECISION=highest  # no TF32 for the oracle's fp32 products on the GPU
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# The oracle's programs compile once per variant, policy and shape (random:llama T=97, two variants with
# gradients: 102 programs, 25 s of a 38 s run on a 2-core CPU), and on the CUDA backend XLA's autotuning adds
# to each compile: autotuning off, programs kept on disk.
export XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache
# torch's inductor, compiling a flex kernel in the same process as the oracle's XLA programs, can wait on its
# compile-worker pool for good. Compile in the process instead (one thread): slower, but nothing to wait on.
export TORCHINDUCTOR_COMPILE_THREADS=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
GGUF=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
weights() {
  [ -f "$GGUF" ] || { echo "no $GGUF: join the parts first (gpu_parity.sh OUT join)"; exit 2; }
  [ -f "$OUT/weights.txt" ] || { sha256sum "$GGUF"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/weights.txt"
}
case $STEP in
seed)
  [ -f "$OUT/.seeded" ] && exit 0
  G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')
  A=results/gpu/parity/parts_$G.tgz
  if [ -f "$A" ]; then
    tar xzf "$A" -C "$OUT" --skip-old-files && echo "seed: $(tar tzf "$A" | grep -c '/[a-z_]*case-[0-9]*\.json$') parts from $A"
  else
    echo "seed: no $A (no earlier session on this GPU kept its parts)"
  fi
  touch "$OUT/.seeded" ;;
join)
  python3 tools/gpu_kit.py join .devkit/parts --stash /tmp/anchor-parts --into .cache/models ;;
smoke)
  for P in ${SMOKE_ON:-cuda cpu}; do
    # at the limit SIGABRT: faulthandler prints where every thread was (a stalled compile shows where it waits)
    JAX_LOG_COMPILES=1 timeout -s ABRT -k 20 ${LIMIT:-240} python3 -X faulthandler -m anchor parity --model random:llama \
      --device cuda --oracle-device $P --engines varlen,flex --policies bf16 --variants intra_doc,anchor --seq-len 97 \
      --grads --no-progress --out "$OUT/smoke_$P" > "$OUT/smoke_$P.log" 2>&1
    echo "smoke with the oracle on $P: exit $?"
    grep -v "Finished\|Compiling\|tracing" "$OUT/smoke_$P.log" | tail -12
    grep -A24 "^Fatal Python error" "$OUT/smoke_$P.log" | head -40
    grep -o "Finished XLA compilation of .* in [0-9.e-]* s" "$OUT/smoke_$P.log" \
      | awk '{s += $(NF-1)} END {print NR " programs compiled in " s " s"}'
  done ;;
parity)
  weights
  T=${T:-1025}
  [ -f "$OUT/parity_$T${GRADS+_forward}/parity.json" ] && { echo "parity $T: done"; exit 0; }
  # at the limit SIGABRT: faulthandler prints where every thread was; the cases finished are kept (OUT/.parity_T.parts)
  timeout -s ABRT -k 20 ${LIMIT:-560} python3 -X faulthandler -m anchor parity --model default --device cuda --oracle-device ${ORACLE:-cuda} \
    --engines varlen,flex --policies bf16 --variants full,intra_doc,intra_doc_reset,anchor --seq-len $T ${GRADS---grads} \
    --keep-parts --no-progress --out "$OUT/parity_$T${GRADS+_forward}" 2>&1 | tail -40 ;;
fanout)  # the parity cases at T=$T with the oracle on the CPU, one process per variant, each on its own
         # $CORES cores (the oracle's XLA threads follow the affinity), in the background: OUT/fanout_${T}_V;
         # then `wait`, and `merge` (OUT/parity_${T}_cpu_oracle)
  weights
  T=${T:-1025}; C=${CORES:-3}; k=0
  python3 -m jaxref.kernels > /dev/null || exit 1  # the CPU kernels built once, before the processes share them
  for V in ${VARIANTS:-full intra_doc intra_doc_reset anchor}; do
    [ -f "$OUT/fanout_${T}_$V/parity.json" ] && { echo "fanout $T $V: done"; continue; }
    setsid nohup taskset -c $((k * C))-$((k * C + C - 1)) timeout ${LIMIT:-480} python3 -m anchor parity \
      --model default --device cuda --oracle-device cpu --engines varlen,flex --policies bf16 --variants $V \
      --seq-len $T ${GRADS---grads} --keep-parts --no-progress --out "$OUT/fanout_${T}_$V" > "$OUT/fanout_${T}_$V.log" 2>&1 < /dev/null &
    echo $! > "$OUT/fanout_$V.pid"; k=$((k + 1))
  done ;;
merge)  # the fanout's reports as one: OUT/parity_${T}_cpu_oracle (tools/merge_parity.py)
  T=${T:-1025}
  python3 tools/merge_parity.py "$OUT/parity_${T}_cpu_oracle" "$OUT"/fanout_${T}_*/ 2>&1 | tail -3 ;;
audit)
  weights
  for E in ${ENGINES:-varlen flex}; do for L in ${LENGTHS:-512 4096}; do
    ls "$OUT/audit_${E}_$L"/*.json > /dev/null 2>&1 && { echo "audit $E $L: done"; continue; }
    timeout ${LIMIT:-140} python3 -m anchor audit --stack torch --engine $E --dtype bfloat16 --model default \
      --seq-len $L --oracle-device ${ORACLE:-cpu} --no-progress --out "$OUT/audit_${E}_$L" 2>&1 | tail -8
  done; done ;;
diag)  # the kernels' attention backward in isolation: OUT/attn_grad_diag.json
  JAX_PLATFORMS=cpu timeout ${LIMIT:-150} python3 experiments/attn_grad_diag/attn_grad_diag.py run .devkit/attn_grad_inputs.npz \
    --out "$OUT/attn_grad_diag.json" 2>&1 | grep -v Warning | tail -8 ;;
start)  # a session's first call: the wheels (installed above), then the CUDA tests in the background on cores 12-15
  [ -f "$OUT/tests.pid" ] || [ -f "$OUT/cuda_tests.log" ] && { echo "tests: started already"; exit 0; }
  taskset -c 12-15 bash "$0" "$OUT" bg tests
  echo "tests: started (pid $(cat "$OUT/tests.pid")), log $OUT/cuda_tests.log" ;;
tests)  # the log names the commit (ANCHOR_COMMIT: the tree here has no .git) and what it ran on
  { echo "commit: ${ANCHOR_COMMIT:-unknown (ANCHOR_COMMIT unset)}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    JAX_PLATFORMS=cpu timeout ${LIMIT:-480} python3 -m pytest -q -p no:cacheprovider -m cuda tests -rs --durations=15
  } 2>&1 | tee "$OUT/cuda_tests.log" | tail -30 ;;
train)
  weights
  JAX_PLATFORMS=cpu timeout ${LIMIT:-560} python3 benchmarks/bench_train_gpu.py --steps ${STEPS:-22} --warmup 2 \
    --out "$OUT/train_gpu.json" ${TRAIN_ARGS:-} 2>&1 | tail -40 ;;
longest)  # the longest window SmolLM2-135M trains on this GPU, one fresh step per doubling from $START (65536), each
         # peak beside the memory plan's prediction (benchmarks/bench_longest_window.py --device cuda; OFFLOAD=1: the
         # checkpoints in host memory): OUT/longest_window_<gpu>.json, rewritten after each length
  weights
  JAX_PLATFORMS=cpu timeout ${LIMIT:-560} python3 benchmarks/bench_longest_window.py --device cuda --start ${START:-65536} \
    ${OFFLOAD:+--offload} --out "$OUT" 2>&1 | tail -20 ;;
phases)
  weights
  JAX_PLATFORMS=cpu timeout ${LIMIT:-300} python3 benchmarks/bench_train_gpu.py --seq-len 16384 --steps 10 --plain sdpa \
    --runs intra_doc/varlen --phases --out "$OUT/train_phases_gpu.json" 2>&1 | tail -12 ;;
paper)  # `make paper-gpu` in parts: the runs $RUNS (e.g. full,anchor) of `make paper-gpu` (README: paper-gpu, "In parts")
        # within $LIMIT (560) s, resumed where the last call stopped (the demo's own resume); HELDOUT=FILE where that
        # Python has no test suite. PROFILE=paper-gpu-short: that profile whole, in one sitting (RUNS not needed).
        # What comes back, no checkpoint: OUT/paper_<profile and runs>/ (demo.json, the summary JSON and its .md,
        # eval/*/eval.json, train/*/metrics.jsonl and config.yaml, the page and figures), for `make paper-gpu-merge`
  weights
  P=${PROFILE:-paper-gpu}
  [ "$P" = paper-gpu ] && : "${RUNS:?paper needs RUNS, e.g. RUNS=full,anchor (or PROFILE=paper-gpu-short)}"
  D=runs/$P${RUNS:+-$(echo "$RUNS" | tr ',@' '--')}
  JAX_PLATFORMS=cpu timeout -k 30 ${LIMIT:-560} python3 -m anchor demo --profile "$P" ${RUNS:+--runs "$RUNS"} --out "$D" \
    ${HELDOUT:+--heldout "$HELDOUT"} --no-progress 2>&1 | tail -20
  mkdir -p "$OUT/paper_${D#runs/}"
  (cd "$D" && find . -path './train/*/checkpoints' -prune -o -type f \( -name demo.json -o -name 'paper_gpu*.json' \
    -o -name 'paper_gpu*.md' -o -name eval.json -o -name metrics.jsonl -o -name config.yaml -o -name index.html \
    -o -name '*.png' \) -print0 | xargs -0 -r cp --parents -t "$OUT/paper_${D#runs/}") ;;
bg)  # gpu_parity.sh OUT bg STEP: STEP in its own session (it outlives the device call), its pid in OUT/STEP.pid
  setsid nohup bash "$0" "$OUT" "${3:?bg needs a step}" > "$OUT/$3.out" 2>&1 < /dev/null &
  echo $! > "$OUT/$3.pid" ;;
wait)  # until every step started with bg (or fanout; WAIT_FOR: a glob of their names) has ended, at most LIMIT seconds (by pid: `pgrep -f` on a step's
       # words also matches the shell of the device call that names them, and waits for itself)
  end=$((SECONDS + ${LIMIT:-560}))
  for f in "$OUT"/${WAIT_FOR:-*}.pid; do
    [ -f "$f" ] || continue
    while kill -0 "$(cat "$f")" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 2; done
    kill -0 "$(cat "$f")" 2>/dev/null && echo "$(basename "$f" .pid) still running" || rm -f "$f"
  done ;;
plan)  # a session's calls 3 and 4 (header), within $BUDGET (540) s: seed, diag (where carried), then side by side the T=1025 cases
       # with the CPU oracle (fanout, 3 cores a variant: cores 0-11, in the background) and, once the tests started
       # by `start` have ended, the T=8192 cases with the oracle on CUDA (cores 12-15); then the fanout's report
       # merged. Again in the next call, it continues
  B=${BUDGET:-540}; S=$SECONDS
  left() { echo $((B - (SECONDS - S) - ${1:-0})); }
  bash "$0" "$OUT" seed
  [ -f .devkit/attn_grad_inputs.npz ] && [ ! -f "$OUT/attn_grad_diag.json" ] && bash "$0" "$OUT" bg diag
  CORES=3 LIMIT=$(left 30) bash "$0" "$OUT" fanout
  [ -f "$OUT/tests.pid" ] && WAIT_FOR=tests LIMIT=$(left 100) bash "$0" "$OUT" wait  # cores 12-15 are the tests'
  [ "$(left 40)" -gt 60 ] && T=8192 ORACLE=cuda LIMIT=$(left 40) taskset -c 12-15 bash "$0" "$OUT" parity
  [ -f "$OUT/parity_8192/parity.json" ] && [ "$(left 40)" -gt 90 ] && \
    LENGTHS=4096 ORACLE=cuda LIMIT=$(( $(left 40) / 2 )) taskset -c 12-15 bash "$0" "$OUT" audit
  LIMIT=$(left 20) bash "$0" "$OUT" wait
  T=1025 bash "$0" "$OUT" merge
  echo "plan: $((SECONDS - S)) s" ;;
*)
  echo "unknown step $STEP"; exit 2 ;;
esac
