# What a compact step runs that the static cycle does not, on the GPU (after calls 1 and 2; carry .xfer/p2):
# batch 64, compact's whole-block tier as a program without conditionals against the static cycle. Brings back
# the optimized HLO of both step loops (XLA's dump: fusion names match the profile's kernel names), every
# kernel per step, and both Perfetto traces (host and device timelines, for where the GPU waits).
#   bash tools/remote_gpu/step_anatomy.sh      (~2 min; writes into $OUT)
source tools/remote_gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
DUMP=/tmp/hlo_dump; rm -rf $DUMP
XLA_FLAGS="--xla_dump_to=$DUMP --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_run" \
  timeout 240 bash tools/remote_gpu/bench.sh tools/profile_gpu_step.py --batches 64 --tiers -1 \
  --cases compact-one-tier,static --steps 16 --repeats 3 --top 1000 --keep-traces /tmp/traces \
  --out $OUT/step_anatomy.json > $OUT/step_anatomy.txt 2>&1
echo "rc $?"; grep "^== " $OUT/step_anatomy.txt
tar czf $OUT/step_anatomy_hlo.tgz -C $DUMP $(cd $DUMP && ls | grep -E "after_optimizations(-buffer-assignment)?\.txt$")
tar czf $OUT/step_anatomy_traces.tgz -C /tmp/traces .
ls -la $OUT
