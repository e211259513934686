# The compact step's tier switch as a CUDA-graph conditional node (XLA's default) against a host-side conditional
# (--xla_gpu_enable_command_buffer=-CONDITIONAL), at batch 64, in one call after calls 1 and 2 (carry .xfer/p2
# and the cost table, e.g. .xfer/table.costs.json: a table of an earlier call, so that none is re-timed here).
#   TABLE=.xfer/table.costs.json bash tools/remote_gpu/conditional_ab.sh      # ~5.5 min
source tools/remote_gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
TABLE=${TABLE:-.xfer/table.costs.json}
NOCOND="--xla_gpu_enable_command_buffer=-CONDITIONAL"
sweep() {  # sweep <tag> <seconds>: AR, static and compact at 64 rows (3 passes a mode interleaved, medians)
  timeout $2 bash tools/remote_gpu/schedule.sh --cost-table $TABLE --batches 64 --max-new 128 --repeats 3 \
    --mixed-per-kind 0 --out $OUT/sweep_64_$1.json > $OUT/sweep_64_$1.txt 2>&1
  echo "sweep $1 rc $?"; grep "^batch" $OUT/sweep_64_$1.txt
}
profile() {  # profile <tag> <seconds>: wall and kernel time of the AR step, compact's AR branch and its tier 64
  timeout $2 bash tools/remote_gpu/bench.sh tools/profile_gpu_step.py --batches 64 --tiers 0 \
    --cases ar,compact-ar,compact-tiers --out $OUT/profile_$1.json > $OUT/profile_$1.txt 2>&1
  echo "profile $1 rc $?"; grep "^== \|timeline" $OUT/profile_$1.txt
}
sweep default 170
XLA_FLAGS="$NOCOND" sweep nocond 170
profile default 100
XLA_FLAGS="$NOCOND" profile nocond 100
