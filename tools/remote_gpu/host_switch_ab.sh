# The host-side tier switch (Tuning.host_tier_switch, plan-ahead compact) against the CUDA-graph conditional
# node, at 64 rows, in one call after calls 1 and 2 (carry .xfer/p2 and, on an H100, .xfer/table.costs.json:
# session 28's H100 rows for 64 / 128; on an H200 the shipped table is the H200's). Ordered by what matters most,
# so a call that runs out of time still brings back the A/B:
#   1. the A/B with the carried / shipped table (both settings schedule with the same table);
#   2. the table's 64 / 128 rows re-timed with this code (compact_recheck.sh 3s), then the sweep at 64 rows with it.
#   export BENCH_COMMIT=<HEAD>; bash tools/remote_gpu/host_switch_ab.sh      (~6–8 minutes)
source tools/remote_gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/recheck
CARRIED=/tmp/recheck/carried.costs.json
if nvidia-smi -L | grep -q H100 && [ -f .xfer/table.costs.json ]; then
  cp .xfer/table.costs.json $CARRIED
else
  cp dflash_jax/assets/costs/gpu.json $CARRIED
fi
sweep64() {  # sweep64 <name> <table> [bench_schedule flags…]
  timeout 240 bash tools/remote_gpu/schedule.sh --cost-table $2 --batches 64 --max-new 128 --repeats 3 \
    --mixed-per-kind 0 "${@:3}" --out $OUT/$1.json > $OUT/$1.txt 2>&1
  echo "$1 ${*:3} rc $?"; grep "^batch" $OUT/$1.txt
  python3 -c "import json, sys; print('tier switch:', json.load(open(sys.argv[1])).get('tier_switch_options'))" \
    $OUT/$1.json
  rm -f $OUT/$1.spectrum.png  # at most 8 files come back from a call
}
sweep64 sweep_64_host $CARRIED
sweep64 sweep_64_node $CARRIED --host-tier-switch off
tar -czf $OUT/ab.tgz -C $OUT sweep_64_host.json sweep_64_node.json && rm $OUT/sweep_64_host.json $OUT/sweep_64_node.json
cp $CARRIED /tmp/recheck/cal.costs.json
bash tools/remote_gpu/compact_recheck.sh 3s
rm -f $OUT/cal.costs.png
sweep64 sweep_64_host_retimed /tmp/recheck/cal.costs.json
