# Compact against static and AR on the GPU after a change to compact's step, in three calls after calls 1 and 2
# (carry .xfer/p2 with each; the machine must stay warm between them: the table of call 1 stays in /tmp/recheck).
#   bash benchmarks/device_runs/compact_recheck.sh 1   # step profile at batch 64, then the cost table (~7 min)
#   bash benchmarks/device_runs/compact_recheck.sh 2   # sweep at batches 32, 16 with that table (~4.5 min)
#   bash benchmarks/device_runs/compact_recheck.sh 3   # sweep at batches 4, 1, 64, 128 (~6 min)
# Everything lands in $OUT; merge cal.costs.json into dflash_jax/assets/costs/gpu.json if it is to ship.
source benchmarks/device_runs/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/recheck
TABLE=/tmp/recheck/cal.costs.json
case "$1" in
  1)
    timeout 150 bash benchmarks/device_runs/bench.sh profile_gpu_step.py --batches 64 --tiers 0,-1 \
      --cases ar,compact-ar,compact-tiers,static --out $OUT/step_profile.json > $OUT/step_profile.txt 2>&1
    echo "profile rc $?"; grep "^== " $OUT/step_profile.txt
    timeout 420 bash benchmarks/device_runs/schedule.sh --calibrate --skip-sweep --mixed-per-kind 0 \
      --batches 1,4,16,32,64,128 --out $OUT/cal.json > $OUT/cal.txt 2>&1
    echo "calibrate rc $?"; grep "^batch\|calibrated" $OUT/cal.txt
    cp $OUT/cal.costs.json $TABLE ;;
  2|3)
    [ -f $TABLE ] || { echo "no $TABLE: run phase 1 on this machine first"; exit 1; }
    BATCHES=$([ "$1" = 2 ] && echo 32,16 || echo 4,1,64,128)
    timeout 560 bash benchmarks/device_runs/schedule.sh --cost-table $TABLE --batches $BATCHES --max-new 128 \
      --mixed-per-kind 0 --out $OUT/sweep_$1.json > $OUT/sweep_$1.txt 2>&1
    echo "sweep rc $?"; grep "^batch" $OUT/sweep_$1.txt ;;
  *) echo "usage: $0 1|2|3" >&2; exit 2 ;;
esac
