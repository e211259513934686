"""XLA's temporaries for one quantized matmul of the Qwen3-8B shape, compiled for an H200 without a GPU: which form
the reference (``kernels/quantized.py``) takes at each row count, and what it writes beside the weights.

Block-scaled fp8 (HF's 128 × 128 blocks) has no fused XLA form, so each row count's temporary — partial products,
scaled activations or a scaled kernel — is bytes the step writes and reads again on top of the weights'. Compile-
time facts (XLA's memory analysis and its fusions), not timings. Needs the CUDA plugin (the venv recipe in
``count_gpu_kernels.py``):

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/gpuvenv/bin/python benchmarks/tools/quant_temporaries.py --rows 1,16,64,128
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import topologies

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))
from count_gpu_kernels import H200, computations  # noqa: E402

from dflash_jax.kernels import quantized  # noqa: E402
from dflash_jax.tuning import Kernels  # noqa: E402

# The 8B layers' [in, out] kernels with more than one block of 128 output columns.
LAYERS = ((4096, 4096), (4096, 12288), (12288, 4096))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,128")
    ap.add_argument("--block", type=int, default=128, help="square scale blocks (rows and columns)")
    args = ap.parse_args()
    device = topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    block = (args.block, args.block)
    backend = jax.default_backend
    jax.default_backend = lambda: "gpu"  # the library picks its GPU forms at trace time
    try:
        for d, e in LAYERS:
            for n in (int(r) for r in args.rows.split(",")):
                fn = lambda x, q, s: quantized.quantized_matmul(x, q, s, block, kernels=Kernels("xla"))  # noqa: E731
                compiled = jax.jit(fn).lower(spec((n, d), jnp.bfloat16), spec((d, e), jnp.float8_e4m3fn),
                                             spec((-(-d // block[0]), -(-e // block[1])), jnp.float32)).compile()
                comps, entry = computations(compiled.as_text())
                kinds = [re.search(r"kind=(\w+)", line).group(1) for line in comps[entry] if "fusion(" in line]
                temp = compiled.memory_analysis().temp_size_in_bytes
                print(f"[{d:5d}, {e:5d}] rows {n:4d}: temporaries {temp / 1e6:7.1f} MB beside {d * e / 1e6:.0f} MB "
                      f"of weights; fusions {' '.join(kinds)}")
    finally:
        jax.default_backend = backend
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
