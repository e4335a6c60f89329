#!/usr/bin/env bash
# One GPU lease: the decisive GPU checks in priority order, in one command of at most 9 minutes on an H100.
#
# Once, on a machine with the package index (the GPU machine has none), fetch the wheels the GPU image lacks into
# .whl/ (ignored by git; about 16 MB; trl, liger-kernel, datasets and its dill and multiprocess, and transformers
# 5.24, the version this project's CPU machines test: the image had 5.17):
#
#   bash bench/experiments/gpu_session.sh fetch-wheels
#
# On the device (the device tool's run, carry [".whl"], timeout_s 600), from the repository root, with the commit
# written out as a literal (the device's copy of the git metadata can be stale; the script refuses to run without it):
#
#   DGPO_OPS_COMMIT=4bc7a51 bash bench/experiments/gpu_session.sh
#
# QuACK's cross-entropy (quack-kernels, an anchor for the logits op) is not among the wheels: its
# nvidia-cutlass-dsl-libs-cu13 wheel is 92 MB, over the 64 MiB a call may carry, and the image has no CUTLASS DSL.
#
# Stages, in this order by default (each ends by writing its results to $OUT; a stage cut short loses only
# itself; a stage starts only while the budget, GPU_SESSION_BUDGET_S = 540 s, has 20 s left, and runs for at
# most the smaller of its own limit and what is left):
#   setup      the wheels and this tree installed into $WORK/site (bench/experiments/install_tree.py: the packages
#              as pyproject.toml maps them), the tree's other files (tests/, bench/, ...) copied to $WORK/run without
#              dgpo_ops/, kernels/ or trainer/, and every later stage run there with PYTHONPATH=$WORK/site: what is
#              imported is the install, never the checkout
#   tests      TRITON_INTERPRET=0 pytest -m cuda tests: 148 tests, 97 of them test_fused_parity's, mostly Triton
#              compiles: 8 pytest-xdist workers where xdist is installed (the GPU image has it; the dry run: -n 0)
#                                                                                                  (limit 210 s)
#   floors     floors.py: copy bandwidth, the bf16 GEMM rate at the fused linear's shapes and 8192^3, and the
#              backward's scale-and-cast kernel against torch.mul into bf16, in this command (limit 40 s)
#   logits     gpu_check.py --timing-only: the logits op fwd + bwd at N = 8192, V = 151,936 bf16 against Liger's
#              triton_grpo_loss and TRL's kernel + loss, back to back and synchronised per call (50 calls, each
#              call's time kept); then V = 32,000, where the call is host-bound; then one synchronised call of ours
#              and of Liger's under torch.profiler (host time before the first kernel, idle time between)
#                                                                                                 (limit 90 s)
#   linear     fused_linear.py at N = 8192, V = 151,936, H = 1,536 and 4,096, autocast and bf16: ours, ours with
#              the row kernels on the side stream (ours_pipelined), ours with the weight casts on it
#              (ours_overlapped_casts), ours on chip, TRL's chunked head, Liger's fused linear, the three-GEMM
#              floor (LINEAR_COMPETITORS, words, replaces the list)                                (limit 120 s)
#   trainstep  train_step.py: one update of Qwen2.5-1.5B's architecture at completions of 2k and 8k,
#              DGPOTrainer(fused="linear") and GRPOTrainer                                        (limit 170 s)
#   passes     passes.py: the GEMM passes over the lm_head weight, per method and path, on CUDA (limit 120 s)
# Other stages, by name only: rows (row_shapes.py: the row kernels alone across launch shapes, the forward of this
# tree against ROWS_BASELINE_FORWARD, another version of kernels/logprob_entropy.py carried as a file, where set;
# in the dry run too) (limit 120 s); and (not in the dry run) plancache (plan_cache_cuda.py: the logits op's plan
# cache where Triton compiles: cached, replayed and uncached calls bit for bit, and the synchronised time per call
# with and without it) (limit 120 s), bench (the benchmark suite, its results JSON as bench.json),
# onchip (on_chip_split.py: the on-chip fused linear's kernels one by one, and other tiles of its gradient kernel:
# ONCHIP_GRAD_SHAPES, ONCHIP_SETTINGS), host (host_overhead.py), repro (the bf16 cuDNN attention repro), mainjob
# (20 bf16 runs of the main job), trainfit (the longest completion).
#
# $OUT receives at most 8 files (the device tool's limit): stages.tsv (stage, exit code, seconds, note),
# session.log (everything printed, and before each stage the load and nvidia-smi's reading), floors.json,
# gpu_check.json, fused_linear.json, train_step.json, passes.json.
#
# GPU_SESSION_DRY_RUN=1 runs every default stage on the CPU at tiny sizes (the torch twins, no CUDA, no wheels
# needed): tests/bench/test_gpu_session.py does, so that the script breaks in CI and not on the GPU.
set -u
TREE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/out}
WORK=${GPU_SESSION_WORK:-/tmp/gpu_session}
DRY=${GPU_SESSION_DRY_RUN:-0}
BUDGET=${GPU_SESSION_BUDGET_S:-540}
PYTHON=${PYTHON:-python3}
SITE=$WORK/site
RUN=$WORK/run
STARTED=$SECONDS
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
LOG=$OUT/session.log
log() { echo "=== $(date +%T) $*" | tee -a "$LOG"; }

fetch_wheels() {
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$TREE/.whl" trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    transformers==5.24.0 && du -ch "$TREE"/.whl/*.whl
}

setup() {
  rm -rf "$SITE" "$RUN"
  mkdir -p "$SITE" "$RUN"
  if [ "$DRY" = 1 ]; then
    echo "dry run: the CPU, no wheels"
  else
    nvidia-smi -L || return 1
    ls "$TREE"/.whl/*.whl > /dev/null 2>&1 || { echo "no wheels in .whl/: run the fetch-wheels stage and carry .whl"; return 1; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$TREE"/.whl/*.whl || return 1
  fi
  if [ "$DRY" != 1 ] && ! PYTHONPATH=$SITE "$PYTHON" -c "import transformers" > /dev/null 2>&1; then
    # transformers checks its dependencies' versions on import: if the image's do not satisfy the carried one,
    # the image's own transformers is the better chance (the stages that need 5.24's API will say so)
    echo "the carried transformers does not import here; using the image's"
    rm -rf "$SITE"/transformers "$SITE"/transformers-*.dist-info
  fi
  "$PYTHON" "$TREE/bench/experiments/install_tree.py" "$SITE" || return 1
  tar -C "$TREE" --exclude=./.git --exclude=./.whl --exclude=./dgpo_ops --exclude=./kernels --exclude=./trainer \
    --exclude=./build --exclude='*.egg-info' --exclude='__pycache__' -cf - . | tar -C "$RUN" -xf - || return 1
  if [ -z "${DGPO_OPS_COMMIT:-}" ]; then  # the install has no git history: name the commit it was copied from
    local commit
    commit=$(git -C "$TREE" rev-parse --short HEAD 2>/dev/null || echo unknown)
    if [ -n "$(git -C "$TREE" status --porcelain -- dgpo_ops kernels trainer 2>/dev/null)" ]; then
      commit="$commit+local-changes"
    fi
    export DGPO_OPS_COMMIT=$commit
  fi
  (cd "$RUN" && PYTHONPATH=$SITE "$PYTHON" - "$SITE" <<'EOF'
import sys

site = sys.argv[1]
import torch, triton, trl, transformers, dgpo_ops, dgpo_ops.kernels, dgpo_ops.trainer  # noqa: E401

for module in (dgpo_ops, dgpo_ops.kernels, dgpo_ops.trainer):
    assert module.__file__.startswith(site), f"{module.__name__} imported from {module.__file__}, not the install"
print("torch", torch.__version__, "triton", triton.__version__, "trl", trl.__version__, "transformers",
      transformers.__version__, "cuda", torch.cuda.is_available(), "dgpo_ops from", dgpo_ops.__file__)
EOF
  )
}

# The load and the GPU's state, logged before each stage: a stage slowed by something else shows it.
machine_state() {
  echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=name,utilization.gpu,memory.used,temperature.gpu,clocks.sm,clocks.mem,power.draw \
      --format=csv,noheader
  else
    echo "nvidia-smi: none (the dry run)"
  fi
}

# run_stage NAME LIMIT_S RESULT_FILE COMMAND...: COMMAND in $RUN for at most min(LIMIT_S, the budget left); then the
# result file (when the command wrote one, even cut short) is copied to $OUT.
run_stage() {
  local name=$1 limit=$2 result=$3
  shift 3
  local left=$((BUDGET - (SECONDS - STARTED)))
  if [ "$left" -lt 20 ]; then
    log "$name skipped: ${left} s of the budget left"
    printf '%s\t-\t0\tskipped: budget\n' "$name" >> "$OUT/stages.tsv"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "$name (at most $limit s)"
  machine_state >> "$LOG" 2>&1
  local begun=$SECONDS lines
  lines=$(wc -l < "$LOG")
  (cd "$RUN" && timeout -k 10 "$limit" "$@") >> "$LOG" 2>&1
  local rc=$?
  tail -n +$((lines + 1)) "$LOG" | tail -n 6  # the stage's last lines, for the device tool's reply
  [ -n "$result" ] && [ -f "$RUN/$result" ] && cp "$RUN/$result" "$OUT/"
  local note=ok
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="cut at $limit s"
  [ "$rc" != 0 ] && [ "$note" = ok ] && note=failed
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - begun))" "$note" >> "$OUT/stages.tsv"
  log "$name: exit $rc after $((SECONDS - begun)) s ($note)"
}

if [ "$DRY" = 1 ]; then
  TESTS=(tests/ops/test_cuda.py)
  # one process: on the CPU every CUDA test skips, and 8 workers (each importing torch) on the 2 cores of a CI
  # machine took 30-80 s to start; the stage's command line is the same but for the number
  TEST_WORKERS=0
  LOGITS_ARGS=(--device cpu --vocab 1000 --tokens 64 --trace-vocab 1000)
  FLOORS_ARGS=(--device cpu --elements 100000 --shapes 64x32x500)
  LINEAR_ARGS=(--sizes 64x32x500 --settings fp32 --competitors ours gemm_floor --repeats 1)
  TRAINSTEP_ARGS=(--model tiny --completions 16 --paths dgpo_linear)
  PASSES_ARGS=(--methods gspo --options all --paths dgpo_linear)
  ROWS_ARGS=(--tokens 64 --vocab 1000 --shapes 2)
else
  TESTS=(tests)
  TEST_WORKERS=8
  LOGITS_ARGS=(--vocab 151936 32000 --tokens 8192 --trace-vocab 151936)
  FLOORS_ARGS=()
  read -r -a LINEAR_COMPETITORS <<< "${LINEAR_COMPETITORS:-ours ours_pipelined ours_overlapped_casts ours_on_chip trl liger gemm_floor}"
  LINEAR_ARGS=(--competitors "${LINEAR_COMPETITORS[@]}" --repeats 3)
  TRAINSTEP_ARGS=(--completions 2048,8192 --paths dgpo_linear,trl)
  PASSES_ARGS=()
  ROWS_ARGS=()
fi
[ -n "${ROWS_BASELINE_FORWARD:-}" ] && ROWS_ARGS+=(--baseline-forward "$TREE/$ROWS_BASELINE_FORWARD")

STAGES=("$@")
[ ${#STAGES[@]} = 0 ] && STAGES=(setup tests floors logits linear trainstep passes)
[ "${STAGES[0]}" = fetch-wheels ] && { fetch_wheels; exit $?; }
[ "${STAGES[0]}" = setup ] || { echo "setup must be the first stage" >&2; exit 2; }
KNOWN_STAGES=" setup tests floors logits linear trainstep passes rows plancache bench onchip host repro trainfit mainjob "
for stage in "${STAGES[@]}"; do  # refused before the setup spends a minute of the lease
  [[ $KNOWN_STAGES == *" $stage "* ]] || { echo "unknown stage $stage (stages:$KNOWN_STAGES)" >&2; exit 2; }
done
if [ "$DRY" != 1 ] && [ -z "${DGPO_OPS_COMMIT:-}" ]; then
  echo "pass the commit measured as a literal: DGPO_OPS_COMMIT=<hash> bash $0 (the device's git metadata can be stale)" >&2
  exit 2
fi
: > "$OUT/stages.tsv"
for stage in "${STAGES[@]}"; do
  case $stage in
  setup)
    log setup
    begun=$SECONDS
    setup >> "$LOG" 2>&1
    rc=$?
    printf 'setup\t%s\t%s\t%s\n' "$rc" "$((SECONDS - begun))" "$([ $rc = 0 ] && echo ok || echo failed)" >> "$OUT/stages.tsv"
    tail -n 3 "$LOG"
    [ $rc = 0 ] || { log "setup failed: nothing else runs"; exit 1; }
    export PYTHONPATH=$SITE DGPO_OPS_COMMIT
    ;;
  tests)
    WORKERS=()
    "$PYTHON" -c "import xdist" 2> /dev/null && WORKERS=(-n "$TEST_WORKERS")
    run_stage tests 210 "" env TRITON_INTERPRET=0 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider "${WORKERS[@]}" \
      "${TESTS[@]}" ;;
  floors)
    run_stage floors 40 floors.json "$PYTHON" bench/experiments/floors.py --out floors.json "${FLOORS_ARGS[@]}" ;;
  logits)
    run_stage logits 90 gpu_check.json "$PYTHON" bench/experiments/gpu_check.py --timing-only --skip-linear --out . \
      "${LOGITS_ARGS[@]}" ;;
  linear)
    run_stage linear 120 fused_linear.json bash -c "$PYTHON bench/fused_linear.py --out-dir scratch-linear \
      ${LINEAR_ARGS[*]}; rc=\$?; cp scratch-linear/fused_linear-*.json fused_linear.json; exit \$rc" ;;
  trainstep)
    run_stage trainstep 170 train_step.json "$PYTHON" bench/train_step.py --repeats 1 --no-search \
      --output train_step.json "${TRAINSTEP_ARGS[@]}" ;;
  passes)
    run_stage passes 120 passes.json "$PYTHON" bench/passes.py --output passes.json "${PASSES_ARGS[@]}" ;;
  rows)
    run_stage rows 120 row_shapes.json "$PYTHON" bench/experiments/row_shapes.py --out row_shapes.json "${ROWS_ARGS[@]}" ;;
  plancache)
    run_stage plancache 120 plan_cache_cuda.json env TRITON_INTERPRET=0 "$PYTHON" bench/experiments/plan_cache_cuda.py \
      --out plan_cache_cuda.json ;;
  bench)
    run_stage bench 600 bench.json bash -c "$PYTHON -m pytest bench/ --benchmark-only -q -p no:cacheprovider \
      --bench-no-report; rc=\$?; cp \$(ls -t bench/results/*.json | head -n 1) bench.json; exit \$rc" ;;
  onchip)
    run_stage onchip 300 on_chip_split.json "$PYTHON" bench/experiments/on_chip_split.py --out on_chip_split.json \
      --settings ${ONCHIP_SETTINGS-bf16 autocast} --grad-shapes ${ONCHIP_GRAD_SHAPES-64,128,32,8,2 128,128,128,8,2} ;;
  host)
    run_stage host 300 host_overhead.json "$PYTHON" bench/experiments/host_overhead.py --out . ;;
  repro)
    run_stage repro 300 "" "$PYTHON" bench/experiments/bf16_cudnn_attention_repro.py ;;
  trainfit)
    run_stage trainfit 600 train_step-fit.json "$PYTHON" bench/train_step.py --completions 2048 --repeats 1 \
      --output train_step-fit.json ;;
  mainjob)
    run_stage mainjob 600 "" bash -c 'for batch in 0 1; do
        for i in $(seq 0 9); do run=$((batch * 10 + i))
          (timeout 260 '"$PYTHON"' -m dgpo_ops.trainer.app.command train --tokenizer chars --generator builtin --max-steps 20 \
             --eval-size 100 --no-progress --output-dir /tmp/mj/$run > /tmp/mj-$run.log 2>&1; echo "run $run rc $?" >> /tmp/mj-rc) &
        done; wait; done; sort -n -k2 /tmp/mj-rc; grep -c "rc 0" /tmp/mj-rc' ;;
  *) log "unknown stage $stage"; exit 2 ;;
  esac
done
log "done in $((SECONDS - STARTED)) s"
cat "$OUT/stages.tsv"
