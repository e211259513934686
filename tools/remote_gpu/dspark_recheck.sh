# The DSpark pair at 64 / 128 rows on this code, in one call after calls 1 and 2: each run calibrates its own
# table (batches 64, 128) and sweeps AR, static and compact with it; first over the whole vocabulary, then
# drafting over the 32,768 most frequent tokens (the embedded ranking; 99.8 % of ShareGPT answer tokens), which
# shrinks the sequential head's per-draft [B, R] × [R, Vd] products and the drafts' logits by a third.
# Carry .xfer/p2 (it assembles the GGUF) with the DSpark drafter tracked and the DFlash one and benchmarks/results
# stashed (~66 MB). ≤ 8 files come back: the second run's plots are dropped.
#   export BENCH_COMMIT=<HEAD>; bash tools/remote_gpu/dspark_recheck.sh      (379 s on an H100)
source tools/remote_gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
run() {  # run <name> <seconds> [bench_schedule flags…]
  timeout $2 bash tools/remote_gpu/schedule.sh --drafter smollm2-135m-dspark --calibrate --batches 64,128 \
    --max-new 128 --mixed-per-kind 0 --repeats 3 "${@:3}" --out $OUT/$1.json > $OUT/$1.txt 2>&1
  echo "$1 ${*:3} rc $?"; grep "^batch\|calibrated" $OUT/$1.txt
}
run dspark 290
run dspark_v32768 270 --draft-vocab 32768
rm -f $OUT/dspark_v32768.costs.png $OUT/dspark_v32768.spectrum.png
