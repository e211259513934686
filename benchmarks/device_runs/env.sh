# Sourced by the device-side scripts (run from the repository root on the GPU machine).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TF_CPP_MIN_LOG_LEVEL=2
M=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf   # assembled from the carried parts by 3_data.sh
CFG=runs/device/smollm2-135m.yaml                # written by prepare.sh
# The CLI keeps compiled programs in ~/.cache/dflash_jax/xla (its default since run 6), so a resumed
# training call loads what the previous call compiled; by its logged average, run 6's second training call
# spent ~135 s before its 25th step. The saving on the GPU is not measured yet.
