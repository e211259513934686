# A benchmark that takes the SmolLM2 GGUF, on the GPU machine after calls 1 and 2 (the GGUF's first two parts in
# /tmp/xfer). Usage: bench.sh <script path under benchmarks/, e.g. tools/profile_gpu_step.py> <its arguments…>; carry .xfer/p2 with the first such call.
source tools/remote_gpu/env.sh
if [ ! -f $M ]; then
  mkdir -p /tmp/model && cat /tmp/xfer/p0 /tmp/xfer/p1 .xfer/p2 > $M || exit 1
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M" | sha256sum -c || exit 1
fi
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache   # a later call on the same machine reuses the programs
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
SCRIPT=$1; shift
python3 benchmarks/$SCRIPT --gguf $M "$@"
