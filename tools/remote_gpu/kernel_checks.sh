# The GPU checks and A/B timings of kernels written but not yet run on a GPU, in one call after calls 1 and 2
# (carry .xfer/p2): their tests, then each path with the new kernel and without it, same call.
#   bash tools/remote_gpu/kernel_checks.sh [batches]     (default 64; ~6 min; writes into $OUT)
source tools/remote_gpu/env.sh
BATCHES=${1:-64}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 150 python3 -m pytest -q -rf tests/test_cuda_kernels.py tests/test_kernel_dispatch.py -k "packed" 2>&1 | tail -4
# compact verify of a hybrid target through the compiled kernels (packed attention, the delta rule's record mode);
# float32 matmuls in full precision (XLA's GPU default is TF32; the test compares against AR token for token)
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -q -rf tests/test_hybrid.py -k "compact" 2>&1 | tail -4
for k in on off; do
  timeout 250 bash tools/remote_gpu/bench.sh tools/profile_gpu_step.py --batches $BATCHES --tiers 0,-1 \
    --cases ar,compact-ar,compact-tiers,static --packed-kernel $k --out $OUT/gpu_step_packed_$k.json \
    > $OUT/gpu_step_packed_$k.txt 2>&1
  echo "packed kernel $k: rc $?"; grep "^== " $OUT/gpu_step_packed_$k.txt
done
