# Self-distillation for DATA_S seconds: chunks run in a seeded random order, so the chunks finished sample
# every prompt source and length; they are merged into data.npz (marked incomplete) for the train stage.
# (Run 6 stopped this stage with `timeout` and merged the parts itself; --stop-after-s does both since.)
source tools/remote_gpu/env.sh
DATA_S=$1
if [ ! -f $M ]; then  # an earlier call of this session (bench.sh) may have assembled it
  mkdir -p /tmp/model && cat /tmp/xfer/p0 /tmp/xfer/p1 .xfer/p2 > $M || exit 1
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M" | sha256sum -c || exit 1
fi
gunzip -c runs/device/prompts.jsonl.gz > /tmp/prompts.jsonl
timeout 590 python3 -m dflash_jax.cli train --config $CFG --stages prompts,data --no-progress \
  --stop-after-s $DATA_S > $OUT/data.log 2>&1
echo "data stage rc $?"
cp $RUN/data_summary.json $OUT/ && cat $RUN/data_summary.json
tail -c 3000 $OUT/data.log | tr '\r' '\n' | tail -n 6
