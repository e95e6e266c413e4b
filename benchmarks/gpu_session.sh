#!/usr/bin/env bash
# The GPU checks of a device session, by part, each part's log into $OUT (one file per part: the device returns few
# files). Run on the device machine from the repository root, after `source .whl/preamble.sh`:
#
#   bash benchmarks/gpu_session.sh tests grid        # ~4-6 min on an H100: the GPU tests, then the full GPU grid
#   bash benchmarks/gpu_session.sh ssd train         # ~4-5 min: the SSD benchmark, then stage-2 training throughput
#
# Parts:
#   tests   the GPU tests of the kernels (SSD, glue, loss), models, LoRA, long-context evaluation, the teacher
#           cache's device path and the teacher forward's host syncs (TRITON_INTERPRET=0: the test suite defaults to
#           the interpreter)
#   grid    benchmarks/ssd_gpu_check.py, all 225 cases in 9 parallel shards, then benchmarks/ssd_long_check.py
#   ssd     benchmarks/ssd.py (ours against mamba_ssm and SDPA, the issue's shapes; ~160 s)
#   train   benchmarks/train_throughput.py --compile --compile-mode reduce-overhead --steps 10 (160m and 410m, student and
#           teacher; ~90 s)
#   cache   benchmarks/cache_throughput.py: the default capture spec (262,144 tokens, to disk, verified) and one layer
#           (a layer-parallel stage-1 worker's spec; 1,048,576 tokens: to tmpfs with 8 writers, the worker's default
#           count (cores / 2) and 8 again, then to disk; the last two also time plain fsynced writes of the same
#           bytes there, `--probe-write`) (~2.5 min)
#   host    benchmarks/ssd_host.py at the host-bound shapes (410m at L=16384 x 1 and 2048 x 8) and 1.4b L=16384: wall,
#           host and kernel time per call, ours and mamba_ssm (~100 s)
# Each log starts with the card's name and the commit, as BENCHMARKS.md rows need them.
set -uo pipefail
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
stamp="$(date -u +%Y-%m-%dT%H%MZ)"
header() {
  echo "# $1, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1),"\
       "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' + changes')"
}
status=0
for part in "$@"; do
  log="$out/gpu_${part}_$stamp.log"
  case "$part" in
    tests)
      { header "GPU tests"
        TRITON_INTERPRET=0 python3 -m pytest -q -n 8 tests/kernels/test_triton_interpret.py \
          tests/kernels/test_model_triton.py tests/kernels/test_feature_map.py tests/kernels/test_compat.py \
          tests/kernels/test_cross_entropy.py \
          tests/kernels/test_cross_entropy_bad_targets.py tests/train/test_loss_kernel.py tests/models/test_gpu.py \
          tests/models/test_lora.py tests/eval/test_long_context.py tests/teacher/cache/test_cache_gpu.py \
          tests/teacher/test_whole_sequences.py; } \
        > "$log" 2>&1 || status=1 ;;
    grid)
      { header "GPU grid (benchmarks/ssd_gpu_check.py, 9 shards) and the long check"
        pids=()
        for i in 0 1 2 3 4 5 6 7 8; do
          python3 benchmarks/ssd_gpu_check.py --shard "$i/9" > "$out/.grid_$i" 2>&1 & pids+=($!)
        done
        bad=0  # a shard that dies (even after printing its PASS) fails the part
        for i in "${!pids[@]}"; do wait "${pids[$i]}" || { echo "shard $i/9 exited with status $?"; bad=1; }; done
        cat "$out"/.grid_* && rm -f "$out"/.grid_*
        python3 benchmarks/ssd_long_check.py && [ "$bad" = 0 ]; } > "$log" 2>&1 || status=1 ;;
    ssd)
      { header "SSD benchmark"; python3 benchmarks/ssd.py; } > "$log" 2>&1 || status=1 ;;
    train)
      { header "stage-2 training throughput"
        python3 benchmarks/train_throughput.py --compile --compile-mode reduce-overhead --steps 10; } > "$log" 2>&1 \
        || status=1 ;;
    cache)
      { header "teacher cache throughput"
        ct="python3 benchmarks/cache_throughput.py --device cuda"
        one="--tokens 1048576 --layers 5 --sequences-per-shard 16 --no-verify"
        $ct --writers 8 --tokens 262144 --sequences-per-shard 8 \
          && $ct --writers 8 $one --out /dev/shm/hmscale-cache-bench \
          && $ct $one --out /dev/shm/hmscale-cache-bench \
          && $ct --writers 8 $one --out /dev/shm/hmscale-cache-bench --probe-write \
          && $ct --writers 8 $one --probe-write; } > "$log" 2>&1 || status=1
      rm -rf /dev/shm/hmscale-cache-bench ;;
    host)
      { header "SSD host time per call"
        python3 benchmarks/ssd_host.py --shapes 410m-16k,410m,1.4b-16k; } > "$log" 2>&1 || status=1 ;;
    *)
      echo "gpu_session.sh: unknown part $part; choose from tests, grid, ssd, train, cache, host" >&2; exit 2 ;;
  esac
  echo "$part: $(tail -1 "$log")"
done
exit $status
