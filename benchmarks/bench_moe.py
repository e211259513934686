"""Routed-expert MLP for decode-sized calls: the grouped Pallas kernel against XLA's three paths.

Shape (default): Qwen3-30B-A3B-like experts in bf16, E=128, D=2048, F=768 (fused gate/up 1536), top-8, at
1, 8, 16 and 64 tokens with random routing. Each implementation is timed as the median over ``--reps`` runs
of a jitted ``fori_loop`` of ``--iters`` dependent calls (the next call's x depends on this call's output),
after warm-up, so the per-call time includes each call's kernel launches but not the host dispatch. The
floor is the routed experts' weight bytes (3·D·F per distinct routed expert) ÷ ``--bandwidth`` (4.0 TB/s).

    python benchmarks/bench_moe.py --out bench_moe.json          # GPU (H200)
    python benchmarks/bench_moe.py --sweep --out bench_moe_sweep.json   # + the kernel's tuning alternatives
    python benchmarks/bench_moe.py --small                       # CPU smoke test (interpret mode)

Implementations: ``kernel`` (dflash_jax.cuda.moe.grouped_experts on a GPU — per-pair kernels up to
``PAIR_MAX_TOKENS`` tokens, the expert-sorted ones above —, dflash_jax.pallas.moe on a TPU; the Triton one in
interpret mode elsewhere), the GPU forms forced: ``sorted`` (sorted_experts), ``pair`` (pair_experts),
``ragged_dot`` (dflash_jax.kernels.moe.experts_grouped), ``gathered`` (moe.experts_gathered: the K
routed experts' weights gathered per token, einsum), ``dense`` (moe.experts_dense: every expert).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax.kernels import moe  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import per_call_seconds, source_commit  # noqa: E402

IMPLS = ("kernel", "sorted", "pair", "ragged_dot", "gathered", "dense")
# Tuning alternatives for --sweep, per GPU kernel (the defaults: sorted 64-wide blocks; pair 32-wide F blocks,
# 128 D rows, 128 F rows per down step, splits for ~4 programs per SM; 4 warps, 3 stages).
SWEEP = {
    "sorted": [dict(block_f=32), dict(block_f=128), dict(block_d=128), dict(block_d=32), dict(num_stages=4),
               dict(num_stages=2), dict(num_warps=8), dict(block_n=128), dict(block_n=32), dict(block_k=128),
               dict(num_splits=1)],
    "pair": [dict(block_f=16), dict(block_f=64), dict(block_d=64), dict(block_d=256), dict(num_splits=1),
             dict(num_splits=2), dict(num_splits=4), dict(num_splits=8), dict(num_warps=2), dict(num_warps=8),
             dict(num_stages=2), dict(num_stages=4), dict(block_n=32), dict(block_n=128), dict(block_k=32),
             dict(block_k=64), dict(block_k=256), dict(block_n=32, block_d=64), dict(num_warps=8, block_d=256)],
}


def kernel_fn(backend: str, name: str, tuning: dict):
    """``kernel``: what experts_auto runs (the GPU dispatcher picks pair or sorted by tokens); the others force
    one GPU form (interpret mode off a GPU)."""
    if backend == "tpu":
        from dflash_jax.pallas import moe as tpu_moe
        return lambda *a: tpu_moe.grouped_experts(*a, **tuning)
    from dflash_jax.cuda import moe as cuda_moe
    fn = {"kernel": cuda_moe.grouped_experts, "sorted": cuda_moe.sorted_experts, "pair": cuda_moe.pair_experts}[name]
    return lambda *a: fn(*a, interpret=backend != "gpu", **tuning)


def impl_fn(name: str, backend: str, tuning: dict):
    if name in ("ragged_dot", "gathered", "dense"):
        return {"ragged_dot": moe.experts_grouped, "gathered": moe.experts_gathered, "dense": moe.experts_dense}[name]
    return kernel_fn(backend, name, tuning)


def time_impl(fn, x, w, idx, gate, up, down, iters: int, reps: int, warm_s: float) -> float:
    """Seconds per call: ``iters`` dependent calls in one program, median over ``reps`` programs."""

    @jax.jit
    def chain(x, w, idx, gate, up, down):
        def body(_, x):
            return x + (fn(x, w, idx, gate, up, down) * 1e-3).astype(x.dtype)  # the next call needs this one
        return jax.lax.fori_loop(0, iters, body, x)

    return per_call_seconds(chain, (x, w, idx, gate, up, down), iters, reps, warm_s)


def make_case(n: int, e: int, d: int, f: int, k: int, dtype, seed: int):
    """Weights drawn on the device; routing: top-k of random logits with softmax weights (numpy, host)."""
    key = jax.random.key(seed)
    draw = jax.jit(lambda key, shape, scale: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
                   static_argnums=(1, 2))
    gate = draw(jax.random.fold_in(key, 0), (e, d, f), d ** -0.5)
    up = draw(jax.random.fold_in(key, 1), (e, d, f), d ** -0.5)
    down = draw(jax.random.fold_in(key, 2), (e, f, d), f ** -0.5)
    x = draw(jax.random.fold_in(key, 3), (n, d), 1.0)
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, e))
    idx = np.argsort(-logits, axis=1)[:, :k]
    top = np.take_along_axis(logits, idx, 1)
    w = np.exp(top - top.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    return x, jnp.asarray(w, dtype), jnp.asarray(idx, jnp.int32), gate, up, down


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", help="token counts (default 1,8,16,64; --small: 1,2,4)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768, help="moe_intermediate_size F (gate and up are [E, D, F] each)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s of the floor")
    ap.add_argument("--iters", type=int, default=100, help="calls per timed program")
    ap.add_argument("--reps", type=int, default=15, help="timed programs per case (median)")
    ap.add_argument("--warm-s", type=float, default=0.5)
    ap.add_argument("--sweep", action="store_true", help="also time the GPU kernel's tuning alternatives")
    ap.add_argument("--small", action="store_true", help="tiny shapes, few runs (CPU smoke test; interpret mode)")
    ap.add_argument("--commit", help="the commit benchmarked (when the tree has no .git)")
    ap.add_argument("--out", default="bench_moe.json")
    args = ap.parse_args()
    backend = jax.default_backend()
    if args.small:
        args.experts, args.dim, args.ffn, args.top_k = 8, 64, 32, 2
        args.tokens, args.iters, args.reps, args.warm_s = args.tokens or "1,2,4", 2, 2, 0.0
    elif backend == "cpu":
        print("no accelerator: use --small for an interpret-mode smoke run", file=sys.stderr)
        return 2
    args.tokens = args.tokens or "1,8,16,64"
    dtype = jnp.dtype(args.dtype)
    e, d, f, k = args.experts, args.dim, args.ffn, args.top_k
    expert_bytes = 3 * d * f * dtype.itemsize
    dev = jax.devices()[0]
    info = dict(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                host=platform.node(), commit=args.commit or source_commit(),
                shape=dict(experts=e, dim=d, ffn=f, top_k=k, dtype=str(dtype)), bandwidth_Bps=args.bandwidth,
                iters=args.iters, reps=args.reps, interpret=backend == "cpu",
                all_experts_floor_us=e * expert_bytes / args.bandwidth * 1e6)
    print(json.dumps(info), flush=True)
    names = args.impls.split(",")
    if backend == "tpu":  # one TPU kernel: the GPU forms are not separate there
        names = [nm for nm in names if nm not in SWEEP]
    configs = [(name, {}) for name in names]
    if args.sweep and backend != "tpu":
        configs += [(name, t) for name in names if name in SWEEP for t in SWEEP[name]]
    rows = []
    t_start = time.perf_counter()
    for n in (int(t) for t in args.tokens.split(",")):
        x, w, idx, gate, up, down = make_case(n, e, d, f, k, dtype, seed=n)
        routed = len(np.unique(np.asarray(idx)))
        floor = routed * expert_bytes / args.bandwidth
        want = jax.jit(moe.experts_gathered)(x, w, idx, gate, up, down)
        for name, tuning in configs:
            fn = impl_fn(name, backend, tuning)
            err = float(jnp.max(jnp.abs(jax.jit(fn)(x, w, idx, gate, up, down).astype(jnp.float32)
                                        - want.astype(jnp.float32))))
            sec = time_impl(fn, x, w, idx, gate, up, down, args.iters, args.reps, args.warm_s)
            row = dict(tokens=n, routed_experts=routed, impl=name, tuning=tuning, us=sec * 1e6,
                       floor_us=floor * 1e6, x_floor=sec / floor, max_abs_err_vs_gathered=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    info["wall_s"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"\n{info['device']}  jax {info['jax']}  commit {info['commit']}  E={e} D={d} F={f} top-{k} {dtype}  "
          f"floor = routed experts' bytes / {args.bandwidth / 1e12:.1f} TB/s (all {e} experts: "
          f"{info['all_experts_floor_us']:.3g} µs)" + ("  INTERPRET MODE (timings meaningless)" * info["interpret"]))
    print("| tokens | routed experts | floor µs | impl | tuning | µs | × floor | max abs err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tun = ",".join(f"{a}={b}" for a, b in r["tuning"].items()) or "default"
        print(f"| {r['tokens']} | {r['routed_experts']} | {r['floor_us']:.3g} | {r['impl']} | {tun} | {r['us']:.1f} | "
              f"{r['x_floor']:.2f} | {r['max_abs_err_vs_gathered']:.2g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
