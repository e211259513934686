"""Gated DeltaNet's short-block delta rule: the fused GPU kernel (dflash_jax.cuda.delta_rule) against the XLA path.

Shape (default): one Qwen3.5-9B linear-attention layer (16 key heads, 32 value heads, Dk = Dv = 128; the conv
output ``qkv [B, T, Hk, 2·Dk + 2·Dv]`` in bfloat16, g / β / state float32) at batch 1 and 8, T = 1 (a decode step)
and 16 (a verify block). Two modes, as the model runs them:

* ``step`` — a decode step / short prompt: the state after all T tokens (kernel: advance mode; XLA: the
  prologue, ``delta_rule_block`` and ``state_after``);
* ``verify`` — a deferred verify block and its settle: the record, then ``state_after`` at the accepted length
  (T - 1 here; kernel: record mode, whose k is per key head; XLA: the prologue, ``delta_rule_block``).

Both include the prologue the kernel absorbs (slicing q / k / v out of ``qkv``, l2norm, the Dk^-½ scale, the
repeat of the key heads to the value heads). Each is timed as the median over ``--reps`` runs of a jitted
``fori_loop`` of ``--iters`` dependent calls (the state carried; the next call's qkv gets ``1e-6·Σout`` added,
so nothing is loop-invariant and ``out`` is used: those two small ops are in every call of both), after
warm-up, so a call's time includes its kernel launches but not the host dispatch. Max abs differences are
against the XLA path (at "highest" matmul precision: IEEE float32 dots, as the kernel computes). The floor is
the state's bytes read + written ÷ ``--bandwidth``.

    python benchmarks/bench_delta_rule.py --out bench_delta_rule.json              # GPU (H200)
    python benchmarks/bench_delta_rule.py --sweep --out bench_delta_rule_sweep.json  # + block_v / num_warps
    python benchmarks/bench_delta_rule.py --interpret                               # CPU smoke test (tiny)
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax.cuda import delta_rule as dr  # noqa: E402
from dflash_jax.kernels import delta_rule as ref  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import per_call_seconds, source_commit  # noqa: E402

MODES = ("step", "verify")
SWEEP = [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)]


def xla_fn(mode: str, dk: int, hk: int):
    """The model's jnp path from the conv output (the reference of :mod:`dflash_jax.kernels.delta_rule`)."""

    def fn(qkv, g, beta, state):
        b, t = qkv.shape[:2]
        hv, _, dv = state.shape[1:]
        q, k = qkv[..., :dk], qkv[..., dk:2 * dk]
        v = qkv[..., 2 * dk:].reshape(b, t, hv, dv).astype(jnp.float32)
        q = jnp.repeat(ref.l2norm(q.astype(jnp.float32)), hv // hk, axis=2) * dk ** -0.5
        k = jnp.repeat(ref.l2norm(k.astype(jnp.float32)), hv // hk, axis=2)
        out, (k_, cum, v_new) = ref.delta_rule_block(q, k, v, g, beta, state)
        return out, ref.state_after(state, k_, cum, v_new, _accepted(mode, b, t))

    return fn


def kernel_fn(mode: str, dk: int, interpret: bool, tuning: dict):
    call = functools.partial(dr.packed_delta_rule_block, key_dim=dk, interpret=interpret, **tuning)

    def fn(qkv, g, beta, state):
        if mode == "step":
            return call(qkv, g, beta, state, advance=True)
        b, t = qkv.shape[:2]
        out, (k, cum, v_new) = call(qkv, g, beta, state)
        return out, ref.state_after(state, k, cum, v_new, _accepted(mode, b, t))

    return fn


def _accepted(mode: str, b: int, t: int):
    """Tokens the state advances over: all of a step; a verify keeps T - 1 (at least 1)."""
    return jnp.full((b,), t if mode == "step" else max(t - 1, 1), jnp.int32)


def time_impl(fn, args, iters: int, reps: int, warm_s: float) -> float:
    """Seconds per call: ``iters`` dependent calls in one program, median over ``reps`` programs."""

    @jax.jit
    def chain(qkv, g, beta, state):
        def body(_, carry):
            qkv, state = carry
            out, state = fn(qkv, g, beta, state)
            return qkv + (jnp.sum(out) * 1e-6).astype(qkv.dtype), state  # the next call needs this one
        return jax.lax.fori_loop(0, iters, body, (qkv, state))

    return per_call_seconds(chain, args, iters, reps, warm_s)


def make_case(b: int, t: int, hk: int, hv: int, dk: int, dv: int, dtype, seed: int):
    """numpy draws (host), moved to the device: qkv ~ N(0, 1), g in [-1, -0.02], β in (0.05, 0.95), state N(0, 1)."""
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.normal(size=(b, t, hk, 2 * dk + hv // hk * dv)).astype(np.float32)).astype(dtype)
    g = jnp.asarray(-rng.uniform(0.02, 1.0, size=(b, t, hv)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.05, 0.95, size=(b, t, hv)).astype(np.float32))
    state = jnp.asarray(rng.normal(size=(b, hv, dk, dv)).astype(np.float32))
    return qkv, g, beta, state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", help="rows (default 1,8; --interpret: 1,2)")
    ap.add_argument("--tokens", help="block lengths T <= MAX_T (default 1,16; --interpret: 1,3)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--key-dim", type=int, default=128)
    ap.add_argument("--value-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="qkv (conv output) dtype")
    ap.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s of the floor")
    ap.add_argument("--iters", type=int, default=200, help="calls per timed program")
    ap.add_argument("--reps", type=int, default=15, help="timed programs per case (median)")
    ap.add_argument("--warm-s", type=float, default=0.5)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's block_v / num_warps alternatives")
    ap.add_argument("--interpret", action="store_true",
                    help="tiny shapes, few runs, the kernel in Pallas interpret mode (CPU smoke test)")
    ap.add_argument("--commit", help="the commit benchmarked (when the tree has no .git)")
    ap.add_argument("--out", default="bench_delta_rule.json")
    args = ap.parse_args()
    backend = jax.default_backend()
    if args.interpret:
        args.key_heads, args.value_heads, args.key_dim, args.value_dim = 2, 4, 16, 32
        args.batch, args.tokens = args.batch or "1,2", args.tokens or "1,3"
        args.iters, args.reps, args.warm_s = 2, 2, 0.0
    elif backend != "gpu":
        print("no GPU: use --interpret for an interpret-mode smoke run", file=sys.stderr)
        return 2
    args.batch, args.tokens = args.batch or "1,8", args.tokens or "1,16"
    dtype = jnp.dtype(args.dtype)
    hk, hv, dk, dv = args.key_heads, args.value_heads, args.key_dim, args.value_dim
    dev = jax.devices()[0]
    info = dict(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                host=platform.node(), commit=args.commit or source_commit(),
                shape=dict(key_heads=hk, value_heads=hv, key_dim=dk, value_dim=dv, dtype=str(dtype)),
                bandwidth_Bps=args.bandwidth, iters=args.iters, reps=args.reps, interpret=args.interpret)
    print(json.dumps(info), flush=True)
    configs = [("xla", {}), ("kernel", {})]
    if args.sweep:
        configs += [("kernel", t) for t in SWEEP if t["block_v"] <= dv and dk * t["block_v"] <= dr.MAX_TILE]
    rows = []
    t_start = time.perf_counter()
    with jax.default_matmul_precision("highest"):  # the XLA path's dots in IEEE float32, as the kernel's math
        for b in (int(x) for x in args.batch.split(",")):
            for t in (int(x) for x in args.tokens.split(",")):
                case = make_case(b, t, hk, hv, dk, dv, dtype, seed=b * 100 + t)
                floor = 2 * b * hv * dk * dv * 4 / args.bandwidth
                for mode in args.modes.split(","):
                    want = jax.jit(xla_fn(mode, dk, hk))(*case)
                    for name, tuning in configs:
                        fn = (xla_fn(mode, dk, hk) if name == "xla" else
                              kernel_fn(mode, dk, args.interpret, tuning))
                        got = jax.jit(fn)(*case)
                        err_out, err_state = (float(jnp.max(jnp.abs(x - y))) for x, y in zip(got, want))
                        sec = time_impl(fn, case, args.iters, args.reps, args.warm_s)
                        row = dict(batch=b, tokens=t, mode=mode, impl=name, tuning=tuning, us=sec * 1e6,
                                   floor_us=floor * 1e6, x_floor=sec / floor, max_abs_err_out=err_out,
                                   max_abs_err_state=err_state)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    info["wall_s"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"\n{info['device']}  jax {info['jax']}  commit {info['commit']}  Hk={hk} Hv={hv} Dk={dk} Dv={dv} "
          f"qkv {dtype}  floor = state bytes read + written / {args.bandwidth / 1e12:.1f} TB/s"
          + ("  INTERPRET MODE (timings meaningless)" * args.interpret))
    print("| batch | T | mode | impl | tuning | µs | floor µs | × floor | max abs err out | max abs err state |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tun = ",".join(f"{a}={b}" for a, b in r["tuning"].items()) or "default"
        print(f"| {r['batch']} | {r['tokens']} | {r['mode']} | {r['impl']} | {tun} | {r['us']:.1f} | "
              f"{r['floor_us']:.3g} | {r['x_floor']:.1f} | {r['max_abs_err_out']:.2g} | "
              f"{r['max_abs_err_state']:.2g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
