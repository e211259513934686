"""Why is a 1-row decode step slower than an 8-row one? Time the Qwen3-8B projection matmuls by row count.

Each case is ``x [M, D_in] @ W [D_in, D_out]`` in bf16 (f32 accumulation, as the model's Dense layers do),
timed as the median of back-to-back calls inside one jitted ``fori_loop`` of ``--iters`` products (so launch
overhead is amortised and only the kernel XLA picked is measured), against the weight-bytes floor.

    python benchmarks/bench_matvec.py --out bench_matvec.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth  # noqa: E402

# (name, D_in, D_out): the target's per-layer projections (q, kv, o, gate+up, down) and the lm_head.
SHAPES = [("q_proj", 4096, 4096), ("kv_proj", 4096, 1024), ("gate_proj", 4096, 12288), ("down_proj", 12288, 4096),
          ("lm_head", 4096, 151936),
          # the same weights fused (one product instead of three / two): does fusing reach the floor at 1 row?
          ("qkv_fused", 4096, 6144), ("gate_up_fused", 4096, 24576)]


def time_matmul(m: int, d_in: int, d_out: int, iters: int, reps: int) -> float:
    """Seconds per product: ``iters`` products in one program (the input changes each time: no CSE)."""
    w = jax.random.normal(jax.random.key(0), (d_in, d_out), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (m, d_in), jnp.bfloat16)

    @jax.jit
    def run(x, w):
        def body(_, x):
            y = jnp.dot(x, w, preferred_element_type=jnp.float32)
            return x + y[:, :1].astype(x.dtype) * 1e-3  # feed back a column: every product is needed
        return jax.lax.fori_loop(0, iters, body, x)

    jax.block_until_ready(run(x, w))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(run(x, w))
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_matvec.json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args()
    shapes = [(n, a // 16, b // 16) for n, a, b in SHAPES] if args.quick else SHAPES
    bw = copy_bandwidth(64 << 20 if args.quick else 4 << 30, 5)
    rows = []
    for name, d_in, d_out in shapes:
        floor = d_in * d_out * 2 / bw
        for m in (int(r) for r in args.rows.split(",")):
            t = time_matmul(m, d_in, d_out, args.iters, args.reps)
            rows.append(dict(shape=name, d_in=d_in, d_out=d_out, rows=m, us=t * 1e6, floor_us=floor * 1e6,
                             over_floor=t / floor))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                          "copy_bandwidth_GBps": bw / 1e9, "rows": rows}, indent=1))
    print(f"\n{jax.devices()[0].device_kind}, copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| shape | rows | µs | floor µs | × floor |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} {r['d_in']}×{r['d_out']} | {r['rows']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['over_floor']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
