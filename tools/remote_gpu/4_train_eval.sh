# Train with time budget TB (stop at STOP s), then optionally eval (EVAL=1) and the batch-32 idle run (IDLE=1).
source tools/remote_gpu/env.sh
TB=$1; STOP=$2; EVAL=$3; IDLE=$4
sed -i "s/time_budget_s: .*/time_budget_s: $TB/" $CFG
if [ "$TB" != 0 ]; then
  timeout 590 python3 -m dflash_jax.cli train --config $CFG --stages train --no-progress --stop-after-s $STOP > $OUT/train.log 2>&1
  echo "train rc $?"; tail -n 3 $OUT/train.log; cat $RUN/plan.json; tail -n 2 $RUN/history.jsonl
  # The weights reached come back with every train call: a machine given back before the next call (30 s
  # idle) takes /tmp with it, and with it the only copy (DSpark run 3 was lost that way at step 2,417).
  [ "$EVAL" = 1 ] || [ ! -d $RUN/drafter ] || (cd $RUN && tar -cf - drafter | split -b 15000000 - $OUT/drafter.tar.part)
fi
if [ "$EVAL" = 1 ]; then
  # The drafter first: an evaluation cut off by the call's limit must not take the trained weights with it.
  python3 -m dflash_jax.cli train --config $CFG --stages export --no-progress > $OUT/export.log 2>&1
  (cd $RUN && tar -cf - drafter | split -b 15000000 - $OUT/drafter.tar.part)
  timeout ${EVAL_S:-400} python3 -m dflash_jax.cli train --config $CFG --stages eval --no-progress > $OUT/eval.log 2>&1
  echo "eval rc $?"
fi
if [ "$IDLE" = 1 ]; then
  python3 -m dflash_jax.cli generate --target $M --drafter dflash_jax/assets/smollm2-135m-dflash --input runs/device/batch_prompts.jsonl --output /tmp/b32.jsonl --batch-size 32 --dtype bfloat16 --max-new-tokens 256 --no-progress > $OUT/b32.log 2>&1
  echo "idle rc $?"; cp /tmp/b32.jsonl.summary.json $OUT/b32_summary.json
  python3 -c "import json; s=json.load(open('/tmp/b32.jsonl.summary.json')); print({k: s.get(k) for k in ('prompts','new_tokens','tau','device_idle_fraction','wall_s','compile_s')})"
fi
(cd $RUN && tar -czf $OUT/records.tgz history.jsonl *.json *.png 2>/dev/null)
grep -h "tau" $OUT/eval.log 2>/dev/null | tail -n 3
