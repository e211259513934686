# Compact against static and AR on the GPU after a change to compact's step, in five calls after calls 1 and 2
# (carry .xfer/p2 with each; the machine must stay warm between them: the table of calls 2–3 stays in /tmp/recheck).
#   bash tools/remote_gpu/compact_recheck.sh 1   # the packed and cache-write kernels' tests; the packed
#                                                      # kernel's short tile timed; step profile at batch 64 of
#                                                      # every compact program, with one tile too (~6 min)
#   bash tools/remote_gpu/compact_recheck.sh 2   # the cost table at batches 1–32 (~5 min)
#   bash tools/remote_gpu/compact_recheck.sh 3   # the table's 64, 128 added; sweep at batch 16 (~6 min)
#   bash tools/remote_gpu/compact_recheck.sh 4   # sweep at batches 32, 4, 1 (~5.5 min)
#   bash tools/remote_gpu/compact_recheck.sh 5   # sweep at batches 64, 128 (~3.5 min)
#   bash tools/remote_gpu/compact_recheck.sh 3s  # instead of 2 and 3 where only batches 64, 128 changed:
#                                                      # the shipped table with 64, 128 re-timed (~3 min)
# The table holds compact's tiers, the step without drafting and the static verify's step (compact runs static's
# program where none of its tiers saves on it). Everything lands in $OUT; merge cal.costs.json into
# dflash_jax/assets/costs/gpu.json if it is to ship.
source tools/remote_gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/recheck
TABLE=/tmp/recheck/cal.costs.json
calibrate() {  # calibrate <batches> <seconds>: adds the batches' rows to $TABLE
  [ -f $TABLE ] && cp $TABLE $OUT/cal.costs.json
  timeout $2 bash tools/remote_gpu/schedule.sh --calibrate --skip-sweep --mixed-per-kind 0 \
    --batches $1 --out $OUT/cal.json > $OUT/cal_${1//,/_}.txt 2>&1
  echo "calibrate $1 rc $?"; grep "^batch\|calibrated" $OUT/cal_${1//,/_}.txt
  cp $OUT/cal.costs.json $TABLE
}
sweep() {  # sweep <batches> <seconds> [bench_schedule flags…]: AR, static and compact on the evaluation prompts
          # with $TABLE (3 passes a mode interleaved, medians: a pass at 64 rows is ~0.5 s, read to ~2 % alone)
  [ -f $TABLE ] || { echo "no $TABLE: run phases 2 and 3 on this machine first"; exit 1; }
  local name=sweep_${1//,/_}$TAG
  timeout $2 bash tools/remote_gpu/schedule.sh --cost-table $TABLE --batches $1 --max-new 128 --repeats 3 \
    --mixed-per-kind 0 "${@:3}" --out $OUT/$name.json > $OUT/$name.txt 2>&1
  echo "sweep $1 ${*:3} rc $?"; grep "^batch" $OUT/$name.txt
  python3 -c "import json, sys; print('tier switch:', json.load(open(sys.argv[1])).get('tier_switch_options'))" \
    $OUT/$name.json
}
case "$1" in
  1)
    # the GPU tests of the packed verify kernel (its short-window tile too) and of the cache-write and K/V
    # placing kernels first
    timeout 150 python3 -m pytest -q -rf tests/test_cuda_kernels.py tests/test_kernel_dispatch.py \
      tests/test_schedule.py -k "packed or write_pending or place_pending" 2>&1 | tail -4
    # the packed kernel's short-window tile against its one tile, the kernel alone
    timeout 150 python3 benchmarks/bench_packed_tile.py --shorts 2,4 --out $OUT/packed_tile.json \
      > $OUT/packed_tile.txt 2>&1
    echo "packed tile rc $?"; grep "^|" $OUT/packed_tile.txt
    # the step profile: every program a compact step can run (with and without the AR offer), against plain AR
    # and static; then compact's tiers with one tile (the short tile is the default)
    timeout 200 bash tools/remote_gpu/bench.sh tools/profile_gpu_step.py --batches 64 --tiers 0,1,-1 \
      --cases ar,compact-ar,compact-tiers,compact-noar,static --keep-traces /tmp/traces \
      --out $OUT/step_profile.json > $OUT/step_profile.txt 2>&1
    echo "profile rc $?"; grep "^== \|timeline" $OUT/step_profile.txt
    timeout 120 bash tools/remote_gpu/bench.sh tools/profile_gpu_step.py --batches 64 --tiers 0,1,-1 \
      --cases compact-tiers --packed-short-tile 0 --keep-traces /tmp/traces/one_tile \
      --out $OUT/step_profile_one_tile.json > $OUT/step_profile_one_tile.txt 2>&1
    echo "profile (one tile) rc $?"; grep "^== " $OUT/step_profile_one_tile.txt
    tar -czf $OUT/step_traces.tgz -C /tmp traces  # benchmarks/tools/read_step_traces.py reads it
    ;;
  2) rm -f $TABLE; calibrate 1,4,16,32 420 ;;
  3)
    [ -f $TABLE ] || { echo "no $TABLE: run phase 2 on this machine first"; exit 1; }
    calibrate 64,128 280
    sweep 16 280 ;;
  3s)
    [ -f $TABLE ] || cp dflash_jax/assets/costs/gpu.json $TABLE
    calibrate 64,128 280 ;;
  4) sweep 32,4,1 560 ;;
  5) sweep 64,128 400 "${@:2}" ;;  # e.g. `5 --packed-short-tile 0` (TAG=_one_tile names its files)
  *) echo "usage: $0 1|2|3|3s|4|5" >&2; exit 2 ;;
esac
