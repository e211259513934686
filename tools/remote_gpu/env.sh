# Sourced by the device-side scripts (run from the repository root on the GPU machine).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TF_CPP_MIN_LOG_LEVEL=2
M=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf   # assembled from the carried parts by 3_data.sh
CFG=${CFG:-runs/device/smollm2-135m.yaml}         # written by prepare.sh (CFG=…-dspark.yaml: the DSpark run)
# The run's output folder, when the call carries its config (calls 1–2 and the benchmarks carry none).
if [ -f $CFG ]; then
  RUN=$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['training']['out_dir'])" $CFG)
fi
# The CLI keeps compiled programs in ~/.cache/dflash_jax/xla (since 93ab1fb, after run 6), so a later call on the
# same machine loads what an earlier one compiled: run 7's resumed training call spent ~59 s before its 12th
# step (run 6, before the cache: ~135 s before its 25th); the batch command compiled 54.6 s, then 9.7 s.
