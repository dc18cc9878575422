#!/usr/bin/env bash
# The project's GPU checks on a GPU machine without network: the real kernels against the oracle with SmolLM2's
# real weights (parity, the torch-stack audit), the CUDA tests, the trainer's throughput against a plain
# transformers loop, and the paper-gpu profile in parts. The machine's Python brings CUDA torch and JAX; what
# else the checks need is copied to it with a checkout of this repository.
# Here, on a machine with network, once a checkout (under a minute):
#   make gpu-kit    (tools/gpu_kit.py kit: .whl, the wheels the GPU machine lacks or holds at another version;
#                   .devkit/parts, the GGUF in two parts sized so copies 2 and 3 leave the tree the same room;
#                   .devkit/heldout.jsonl; .devkit/kit.json, each copy below measured with the working tree,
#                   refused over `--transfer-mib` where one copy to the machine is limited in size)
# There, with the checkout and .whl copied (every step installs the wheels where /tmp/site is missing):
#   bash tools/gpu_parity.sh OUT start
# then, after each copy of .devkit/parts/manifest.json and one .devkit/parts/*.part-NNN (or of all the parts at
# once, where one copy may hold them):
#   bash tools/gpu_parity.sh OUT join
# then (nothing more to copy): bash tools/gpu_parity.sh OUT STEP, STEP one of
#   start    the CUDA tests (`tests`) in the background on cores 12-15, once per OUT: they need no weights, so
#            they run while the weights are copied
#   seed     once per OUT, before any parity step: the parts an earlier run on this GPU kept
#            (results/gpu/parity/parts_<gpu>.tgz, tracked: `gpu_kit.py keep R` here after each run)
#            unpacked into OUT. Parity runs with --keep-parts, whose keys hold the code, the library versions and
#            the GPU: a carried case is taken only where all are this run's, else computed again
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
#   paper    `make paper-gpu` in parts, one part a command: RUNS=full, then anchor, intra_doc, intra_doc_reset,
#            then intra_doc@fp32,intra_doc_reset@fp32 (HELDOUT=.devkit/heldout.jsonl, copied: the machine's Python
#            may have no test suite); OUT/paper_<runs>/ joined here by `make paper-gpu-merge PARTS=...`; or
#            PROFILE=paper-gpu-short, the four bf16 runs in one command, a quick check of a GPU machine before
#            the long runs. Needs deepspeed and hjson among the wheels (ZeRO-1)
#   diag     experiments/attn_grad_diag/attn_grad_diag.py: one attention layer's backward on the varlen and flex
#            kernels against fp64 and the emulations (inputs captured here: .devkit/attn_grad_inputs.npz, 10 MB,
#            copied)
#   plan     the parity checks within $BUDGET s: seed; diag (where its inputs were copied: `gpu_kit.py kit
#            --attention-inputs`, 10 MiB more with copy 3); the T=1025 fanout (CPU oracle) on cores 0-11 and,
#            once `start`'s tests have ended, T=8192 with the oracle on CUDA on cores 12-15, side by side, then
#            (8192 done) the audits at L=4096 with the oracle on CUDA; merge. Run again, it continues: a step
#            whose report is written is skipped, a stopped one resumes from its kept cases
#   bg STEP  STEP in the background, detached (setsid): it outlives the command that started it
#   wait     until the background steps have ended (at most $LIMIT s)
# The commands in order, R=/tmp/res on the GPU machine, each ending with `tar czf $OUT/r.tgz -C /tmp/res .`
# (the results so far, packed to copy back; OUT: where the command's output is collected). .devkit/kit.json
# has each copy's MiB with the tree and, under "commands", each command with the commit filled in and its
# timeout_s (the seconds to allow it). The CUDA tests first:
#   1 (copy .whl; timeout_s 120)        ANCHOR_COMMIT=<the checkout's commit> bash tools/gpu_parity.sh R start
#                                       (the wheels installed, `pytest -m cuda` started in the background on
#                                       cores 12-15: it outlives the command; the commit heads its log, since a
#                                       tree copied without .git cannot name it)
#   2 (copy manifest, part-000; timeout_s 60)    gpu_parity.sh R join; tar ...
#   3 (copy manifest, part-001; timeout_s 590)
#                                       gpu_parity.sh R join && BUDGET=540 gpu_parity.sh R plan; tar ...
#     (the plan waits for the tests before it gives cores 12-15 to T=8192)
#   4 (nothing to copy) the plan again, S seconds at a time (timeout_s S), until it reports every step done:
#                                       BUDGET=<S less 20> gpu_parity.sh R plan; tar ...
#   after, here: the results unpacked into R, `python tools/gpu_kit.py keep R` (this GPU's parts, for its next
#   run: commit results/gpu/parity/parts_<gpu>.tgz), tools/merge_parity.py (the report) and R/cuda_tests.log
#   kept as results/gpu/cuda_tests_<gpu>.log
# The smoke (the oracle on JAX's CUDA backend against its CPU one, random:llama T=97) is not a step of the plan,
# whose T=8192 cases run the same backend on the real model: run it alone to check the backend first.
# For paper-gpu: commands 1 and 2 as above (1 with `seed` instead of `start`: the CUDA tests would share the GPU
# with the timed runs); 3 (copy manifest, part-001, .devkit/heldout.jsonl)
# `gpu_parity.sh R join && RUNS=full HELDOUT=.devkit/heldout.jsonl LIMIT=560 gpu_parity.sh R paper`; if it
# stopped at its limit, the same again (the demo resumes from its newest checkpoint, kept under runs/).
# `train`, `longest` and `phases` time the trainer: run them after the parity plan, alone on the machine.
# The oracle on the CPU at T=8192 (SmolLM2, 2 cores; experiments/oracle_cost): a forward with taps 67 s in
# fp64, 42 s in fa2_bf16 (a variant's forward cases: fp64 and 4 summation orders, ~4 minutes; on 16 cores,
# well under ten minutes for the four); one fp64 gradient takes over 15 minutes (memory-bound on
# [heads, T, T] fp64 scores, and a gradient case takes 3 steps in each of 2 policies): gradients at 8192
# need the oracle on CUDA. Its memory there (benchmarks/bench_oracle_grad_memory.py: XLA's plan of the gradient
# program compiled on a CPU, not run; results/memory/oracle_grad_memory_cpu.json): at T=8192 15.7 GiB in
# fp64 and 7.7 in fa2_bf16 or flex_bf16 (1025: 4.5 and 1.8), well inside an H100's 80 beside the torch model;
# each such program takes 20-26 s to compile on a CPU.
# A parity step stopped at its limit keeps the cases it finished (OUT/.parity_$T.parts); the same step run
# again computes only the rest.
# The fanout at T=1025 with gradients, 4 cores a variant: about 5 minutes a variant (each gradient case draws the
# emulation in 8 summation orders, parity_tests/grads.py: a bf16 gradient 23 s at T=1025 on 2 cores,
# experiments/grad_baseline/results/grad_draws_cpu_sdpa.json), within one plan's BUDGET; at T=8192 with the
# oracle on the CPU no case finishes within a step's LIMIT.
# Results under OUT: weights.txt (the joined file's sha256 and the GPU), parity_$T/ (parity_${T}_forward/ with GRADS=), audit_{varlen,flex}_{512,4096}/,
# cuda_tests.log, train_gpu.json, train_phases_gpu.json; each step stops at its LIMIT (at most 560 s by default)
# and keeps what it finished. Copied back, they are kept under results/gpu/ (parity reports in
# results/gpu/parity/, after tools/merge_parity.py --slim) and results/gpu/ (train_gpu_<gpu>.json).
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
    echo "seed: no $A (no earlier run on this GPU kept its parts)"
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
start)  # the first command: the wheels (installed above), then the CUDA tests in the background on cores 12-15
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
        # within $LIMIT (560) s, resumed where the last command stopped (the demo's own resume); HELDOUT=FILE where
        # that Python has no test suite. PROFILE=paper-gpu-short: that profile whole, in one command (RUNS not needed).
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
bg)  # gpu_parity.sh OUT bg STEP: STEP detached by setsid (it outlives the command that started it), its pid in OUT/STEP.pid
  setsid nohup bash "$0" "$OUT" "${3:?bg needs a step}" > "$OUT/$3.out" 2>&1 < /dev/null &
  echo $! > "$OUT/$3.pid" ;;
wait)  # until every step started with bg (or fanout; WAIT_FOR: a glob of their names) has ended, at most LIMIT seconds (by pid: `pgrep -f` on a step's
       # words also matches the shell of the command that names them, and waits for itself)
  end=$((SECONDS + ${LIMIT:-560}))
  for f in "$OUT"/${WAIT_FOR:-*}.pid; do
    [ -f "$f" ] || continue
    while kill -0 "$(cat "$f")" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 2; done
    kill -0 "$(cat "$f")" 2>/dev/null && echo "$(basename "$f" .pid) still running" || rm -f "$f"
  done ;;
plan)  # commands 3 and 4 (header), within $BUDGET (540) s: seed, diag (where copied), then side by side the T=1025 cases
       # with the CPU oracle (fanout, 3 cores a variant: cores 0-11, in the background) and, once the tests started
       # by `start` have ended, the T=8192 cases with the oracle on CUDA (cores 12-15); then the fanout's report
       # merged. Run again, it continues
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
