# Self-distillation data for DATA_S seconds (chunks in seeded random order), then merge the parts written.
source benchmarks/device_runs/env.sh
DATA_S=$1
mkdir -p /tmp/model && cat /tmp/xfer/p0 /tmp/xfer/p1 .xfer/p2 > $M || exit 1
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M" | sha256sum -c || exit 1
gunzip -c runs/device/prompts.jsonl.gz > /tmp/prompts.jsonl
date +%s > /tmp/t_data
timeout $DATA_S python3 -m dflash_jax.cli train --config $CFG --stages prompts,data --no-progress > $OUT/data.log 2>&1
echo "data stage rc $? after $(( $(date +%s) - $(cat /tmp/t_data) )) s"
python3 - <<'PY'
import json, pathlib
from dflash_jax.train.pipeline import Pipeline
out = pathlib.Path("/tmp/run")
if not (out / "data.npz").is_file():
    parts = [p for p in sorted((out / "data_parts").glob("part_*.npz")) if ".tmp" not in p.name]
    s = Pipeline._merge_parts(parts, out / "data.npz")
    s["parts"] = len(parts)
    (out / "data_summary.json").write_text(json.dumps(s, indent=1))
print(open(out / "data_summary.json").read())
PY
cp /tmp/run/data_summary.json $OUT/
tail -c 3000 $OUT/data.log | tr '\r' '\n' | tail -n 6
