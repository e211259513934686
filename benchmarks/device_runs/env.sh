# Sourced by the device-side scripts (run from the repository root on the GPU machine).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TF_CPP_MIN_LOG_LEVEL=2
M=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf   # assembled from the carried parts by 3_data.sh
CFG=runs/device/smollm2-135m.yaml                # written by prepare.sh
# Persistent XLA cache: a resumed training call then reuses the programs the previous call compiled (every
# length bucket; call 5 of run 6 spent ~135 s before its 25th step). Added after run 6; not measured yet.
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
