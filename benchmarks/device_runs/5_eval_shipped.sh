# τ of the shipped DFlash drafter on evaluation sets (default: the general chat set), with the run config's eval
# settings, through the same eval stage: its drafter is copied where that stage looks (/tmp/shipped/drafter).
source benchmarks/device_runs/env.sh
SETS=${1:-general}
rm -rf /tmp/shipped && mkdir -p /tmp/shipped && cp -r dflash_jax/assets/smollm2-135m-dflash /tmp/shipped/drafter
python3 - "$CFG" "$SETS" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
cfg["training"]["out_dir"] = "/tmp/shipped"
cfg["training"]["drafter"].update(kind="dflash", block_size=16)
cfg["training"]["eval"]["sets"] = [f"runs/device/{s}.jsonl" for s in sys.argv[2].split(",")]
yaml.safe_dump(cfg, open("/tmp/shipped/eval.yaml", "w"), sort_keys=False)
PY
python3 -m dflash_jax.cli train --config /tmp/shipped/eval.yaml --stages eval --no-progress > $OUT/eval_shipped.log 2>&1
echo "shipped eval rc $?"; cp /tmp/shipped/eval.json $OUT/eval_shipped.json
grep -h "tau" $OUT/eval_shipped.log | tail -n 3
