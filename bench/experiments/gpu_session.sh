#!/usr/bin/env bash
# One GPU lease of the device tool, in stages that each fit its 10-minute command limit.
#
#   DGPO_OPS_COMMIT=<sha> bash bench/experiments/gpu_session.sh STAGE...
#
# Stages: setup (wheels from .whl/ and this tree into /tmp/site; always first), tests (the CUDA tests),
# bench (pytest bench/ --benchmark-only), linear (bench/fused_linear.py), timing (gpu_check.py
# --timing-only: back-to-back times of the logits op), host (host_overhead.py: host submit time and
# profile), repro (the bf16 cuDNN attention repro), mainjob (20 bf16 runs of the main job, 10 at a
# time), trainstep (bench/train_step.py: one policy update of Qwen2.5-1.5B's architecture per path at
# completions of 2k, 8k and 16k), trainfit (its search for the longest completion that fits, per path).
# Logs, JSON and results go to $OUT (one tarball, results.tgz, plus session.log).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1
log() { echo "=== $(date +%T) $*"; }
for stage in "$@"; do
  case $stage in
  setup)
    log setup
    nvidia-smi -L
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
      || exit 1
    # The tree itself imports as the installed package (pytest and `python -c` put it first on sys.path).
    ln -sfn ../kernels dgpo_ops/kernels && ln -sfn ../trainer dgpo_ops/trainer
    export PYTHONPATH=$PWD:/tmp/site
    export PATH=/tmp/site/bin:$PATH
    python3 -c "import torch, triton, trl, liger_kernel, dgpo_ops; print(torch.__version__, triton.__version__, trl.__version__, dgpo_ops.__file__)"
    ;;
  tests)
    log tests
    TRITON_INTERPRET=0 python3 -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tail -n 25 | tee "$OUT/r/cuda-tests.log"
    ;;
  bench)
    log bench
    python3 -m pytest bench/ --benchmark-only -q -p no:cacheprovider 2>&1 | tail -n 40 > "$OUT/r/bench.log"
    tail -n 3 "$OUT/r/bench.log"
    cp bench/results/cuda-*.json "$OUT/r/" 2>/dev/null
    ;;
  linear)
    log linear
    python3 bench/fused_linear.py --out-dir "$OUT/r" 2>&1 | tail -n 30 | tee "$OUT/r/fused_linear.log"
    ;;
  timing)
    log timing
    python3 bench/experiments/gpu_check.py --timing-only --skip-linear --out "$OUT/r" 2>&1 | tail -n 30 | tee "$OUT/r/timing.log"
    ;;
  host)
    log host
    python3 bench/experiments/host_overhead.py --out "$OUT/r" 2>&1 | head -n 60 | tee "$OUT/r/host.log"
    ;;
  trainstep)
    log trainstep
    python3 bench/train_step.py --no-search 2>&1 | tail -n 30 | tee "$OUT/r/train_step.log"
    cp bench/results/train_step-*.json bench/results/train_step-*.md bench/plots/train_step-*.png "$OUT/r/" 2>/dev/null
    ;;
  trainfit)
    log trainfit
    python3 bench/train_step.py --completions 2048 --repeats 1 --output "$OUT/r/train_step-fit.json" 2>&1 \
      | tail -n 30 | tee "$OUT/r/train_fit.log"
    ;;
  repro)
    log repro
    python3 bench/experiments/bf16_cudnn_attention_repro.py 2>&1 | tail -n 20 | tee "$OUT/r/repro.log"
    ;;
  mainjob)
    log mainjob
    for batch in 0 1; do
      for i in $(seq 0 9); do
        run=$((batch * 10 + i))
        (timeout 260 python3 -m dgpo_ops.trainer.command train --tokenizer chars --generator builtin --max-steps 20 --eval-size 100 \
           --no-progress --output-dir /tmp/mj/$run > /tmp/mj-$run.log 2>&1; echo "run $run rc $?" >> /tmp/mj-rc) &
      done
      wait
    done
    sort -n -k2 /tmp/mj-rc | tee "$OUT/r/mainjob-rc.txt"
    for run in $(seq 0 19); do
      echo "--- run $run"; grep -i -E "non-finite|nan|accuracy|Error|assert" /tmp/mj-$run.log | tail -n 6
    done > "$OUT/r/mainjob-summary.txt" 2>&1
    tail -n 40 /tmp/mj-0.log > "$OUT/r/mainjob-run0-tail.log"
    grep -c "rc 0" /tmp/mj-rc
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
log done
tar czf "$OUT/results.tgz" -C "$OUT" r
