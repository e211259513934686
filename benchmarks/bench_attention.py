"""Attention kernels (:mod:`dflash_jax.cuda.attention`) vs the XLA references (:mod:`dflash_jax.kernels.attention`)
vs the KV-bytes floor (run on a GPU machine).

Shapes: Qwen3-8B attention (N=32 query heads, K=8 KV heads, H=128, bf16), block / window L=16, batch
1/8/32, context 1k/4k/16k/32k, full contexts (ctx_len = S for the drafter op, kv_len = S for verify).

* draft: ``cuda_attention.draft_attention`` vs ``jax.jit(attention.draft_attention)`` (the reference).
* verify: ``cuda_attention.ragged_verify_attention`` (every window ℓ_r = L) vs ``jax.jit(attention.cache_attention)``
  with q [B, L, N, H] at positions ``S - L + i``: the static-window verify of today's decode loop.

Floor = bytes that must move (live K/V rows + q read + output written) ÷ the larger of the measured device
copy bandwidth (a large device-to-device copy, bytes read + bytes written, as in bench_decode.py) and read
bandwidth (a large reduction): the kernels are almost pure reads, which run faster than XLA's copy.

Timing: one jitted program makes ``--calls`` back-to-back calls, each depending on the previous output (a
scalar of it feeds the next call's lengths, which leaves them unchanged), and rotating among enough copies of
the cache that the working set is well past the 60 MB L2. After a warm-up of ``--min-seconds`` (GPU clocks
drop while the host compiles), per-call time = median over the timed runs of that program ÷ calls (dispatch
is paid once per program; launch gaps and the tiny dependency op are included in both columns, so small
cases are launch-bound for both).

    python benchmarks/bench_attention.py --out results.json           # on the GPU (~3 min)
    python benchmarks/bench_attention.py --quick                      # CPU smoke run (interpret mode)
    python benchmarks/bench_attention.py --sweep                      # tuning sweep on a few shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import copy_bandwidth, read_bandwidth, source_commit  # noqa: E402
from dflash_jax.cuda import attention as cuda_attention  # noqa: E402
from dflash_jax.kernels import attention  # noqa: E402

QWEN3_8B = dict(n=32, k=8, h=128)
L2_BYTES = 60 << 20  # H200 L2; the rotated working set is kept above 4x this


def _dep(out: jax.Array, lens: jax.Array) -> jax.Array:
    """lens unchanged, but data-dependent on out (so calls can neither be reordered nor merged)."""
    x = out.reshape(-1)[0]
    return lens + (x != x).astype(lens.dtype)


def time_chain(op, static_args, caches, lens, calls: int, repeats: int,
               min_seconds: float = 0.3) -> tuple[float, jax.Array, float]:
    """Median seconds per call of ``op(*static_args, k, v, lens)`` over ``calls`` chained calls; first output."""

    @jax.jit
    def chain(caches, lens):
        first = None
        for i in range(calls):
            k, v = caches[i % len(caches)]
            out = op(*static_args, k, v, lens)
            first = out if first is None else first
            lens = _dep(out, lens)
        return first, lens

    t0 = time.perf_counter()
    first, _ = jax.block_until_ready(chain(caches, lens))
    compile_s = time.perf_counter() - t0
    # Keep the GPU busy for a while first: after the idle compile its clocks are down, and a few ms of
    # timed work would be measured before they come back up.
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_seconds:
        jax.block_until_ready(chain(caches, lens))
    times = []
    t0 = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - t0 < min_seconds:
        t = time.perf_counter()
        jax.block_until_ready(chain(caches, lens))
        times.append(time.perf_counter() - t)
    return statistics.median(times) / calls, first, compile_s


def make_case(b: int, s: int, l: int, n: int, k: int, h: int, dtype, copies: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4 + 2 * copies)
    gen = jax.jit(lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype), static_argnums=1)
    caches = [(gen(ks[4 + 2 * i], (b, s, k, h)), gen(ks[5 + 2 * i], (b, s, k, h))) for i in range(copies)]
    q = gen(ks[0], (b, l, n, h))
    blk_k, blk_v = gen(ks[1], (b, l, k, h)), gen(ks[2], (b, l, k, h))
    return q, blk_k, blk_v, caches


def run_case(op: str, b: int, s: int, args, bw: float, tuning: dict, interpret: bool, with_ref: bool = True) -> dict:
    l, n, k, h, dtype = args.block, args.n, args.k, args.h, jnp.dtype(args.dtype)
    item = dtype.itemsize
    kv_bytes = 2 * b * s * k * h * item
    copies = max(1, min(args.calls, -(-4 * L2_BYTES // kv_bytes))) if not interpret else 1
    q, blk_k, blk_v, caches = make_case(b, s, l, n, k, h, dtype, copies)
    full = jnp.full((b,), s, jnp.int32)
    q_bytes = 2 * b * l * n * h * item  # q read + output written
    if op == "draft":
        pos = s + jnp.arange(l, dtype=jnp.int32)[None].repeat(b, 0)
        moved = kv_bytes + 2 * b * l * k * h * item + q_bytes

        def ref(q, blk_k, blk_v, pos, kc, vc, lens):
            return attention.draft_attention(q, kc, vc, blk_k, blk_v, pos, lens)

        def ker(q, blk_k, blk_v, pos, kc, vc, lens):
            return cuda_attention.draft_attention(q, kc, vc, blk_k, blk_v, pos, lens, interpret=interpret, **tuning)

        statics = (q, blk_k, blk_v, pos)
        ref_statics = statics
        tiling_rows = l
    else:
        moved = kv_bytes + q_bytes
        cu = jnp.arange(b + 1, dtype=jnp.int32) * l
        qr = q.reshape(b * l, n, h)

        def ref(q, kc, vc, lens):
            pos = lens[:, None] - l + jnp.arange(l, dtype=jnp.int32)[None]
            return attention.cache_attention(q, kc, vc, pos)

        def ker(q, cu, kc, vc, lens):
            return cuda_attention.ragged_verify_attention(q, kc, vc, cu, lens, max_q_len=l, interpret=interpret,
                                                **tuning).reshape(b, l, n, h)

        statics, ref_statics = (qr, cu), (q,)
        tiling_rows = l
    secs = 0.0 if interpret else args.min_seconds
    t_ker, out_ker, c_ker = time_chain(ker, statics, caches, full, args.calls, args.repeats, secs)
    if with_ref:
        t_ref, out_ref, c_ref = time_chain(ref, ref_statics, caches, full, args.calls, args.repeats, secs)
        err = float(jnp.abs(out_ker.astype(jnp.float32) - out_ref.astype(jnp.float32)).max())
    else:
        t_ref, c_ref, err = float("nan"), 0.0, float("nan")
    til = cuda_attention._make_tiling(rows=tiling_rows, n=n, k=k, h=h, s=s, programs=b * k, dtype=dtype,
                            block_k=tuning.get("block_k"), num_splits=tuning.get("num_splits"),
                            min_chunk=tuning.get("min_chunk", cuda_attention.DEFAULT_MIN_CHUNK),
                            num_warps=tuning.get("num_warps"),
                            num_stages=tuning.get("num_stages"))
    floor = moved / bw
    row = dict(op=op, batch=b, context=s, L=l, N=n, K=k, H=h, dtype=dtype.name, ref_us=t_ref * 1e6,
               kernel_us=t_ker * 1e6, floor_us=floor * 1e6, speedup=t_ref / t_ker, kernel_over_floor=t_ker / floor,
               kernel_GBps=moved / t_ker / 1e9, max_abs_err=err, num_splits=til.num_splits, block_k=til.block_k,
               num_warps=til.num_warps, num_stages=til.num_stages, cache_copies=copies,
               compile_s=round(c_ref + c_ker, 2), tuning=tuning)
    print(json.dumps(row), flush=True)
    del caches
    return row


def sweep(args, bw: float) -> list[dict]:
    """Time a grid of tuning settings on a few shapes (for picking defaults); prints the best per shape."""
    rows = []
    shapes = [("verify", 1, 16384), ("verify", 8, 4096), ("draft", 1, 32768)]
    grid = [dict(block_k=bk, num_stages=st) for bk, st in itertools.product((32, 64, 128), (2, 3))]
    for op, b, s in shapes:
        best = None
        for tun in grid + [dict(num_splits=ns) for ns in (8, 16, 32, 48, 64, 128) if ns * 128 <= s]:
            try:
                r = run_case(op, b, s, args, bw, tun, False, with_ref=False)
            except Exception as e:  # noqa: BLE001 — a config that does not compile is just skipped
                print(json.dumps(dict(op=op, batch=b, context=s, tuning=tun, error=str(e)[:200])), flush=True)
                continue
            rows.append(r)
            if best is None or r["kernel_us"] < best["kernel_us"]:
                best = r
        print(f"BEST {op} B{b} S{s}: {best['tuning']} {best['kernel_us']:.1f} us "
              f"({best['kernel_over_floor']:.2f}x floor)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--ops", default="draft,verify")
    ap.add_argument("--block", type=int, default=16, help="L: drafter block / verify window")
    ap.add_argument("--calls", type=int, default=16, help="chained calls per timed program")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs (at least --min-seconds of them)")
    ap.add_argument("--min-seconds", type=float, default=0.3, help="warm-up time, and least timed time, per chain")
    ap.add_argument("--max-gib", type=float, default=24.0, help="skip cases whose caches need more GPU memory")
    ap.add_argument("--block-k", type=int)
    ap.add_argument("--num-splits", type=int)
    ap.add_argument("--min-chunk", type=int)
    ap.add_argument("--num-warps", type=int)
    ap.add_argument("--num-stages", type=int)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: both sides at JAX's default matmul precision (TF32 dots on a GPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    ap.add_argument("--sweep", action="store_true", help="tuning sweep instead of the table")
    ap.add_argument("--commit", help="the commit benchmarked (when the tree has no .git)")
    args = ap.parse_args()
    args.n, args.k, args.h = QWEN3_8B["n"], QWEN3_8B["k"], QWEN3_8B["h"]
    interpret = jax.default_backend() != "gpu"
    if args.quick:
        args.n, args.k, args.h, args.block = 8, 2, 64, 8
        args.batches, args.contexts, args.calls, args.repeats = "1,2", "128,512", 2, 2
    elif interpret:
        print("no GPU backend: use --quick for an interpret-mode smoke run", file=sys.stderr)
        return 2
    tuning = {name: getattr(args, name) for name in ("block_k", "num_splits", "min_chunk", "num_warps",
                                                        "num_stages") if getattr(args, name) is not None}
    if args.quick:  # small blocks and chunks so the split-KV path runs too
        tuning.setdefault("block_k", 32)
        tuning.setdefault("min_chunk", 128)

    dev = jax.devices()[0]
    copy_bw = copy_bandwidth(64 << 20, 5) if args.quick else copy_bandwidth()
    read_bw = read_bandwidth(64 << 20, 5) if args.quick else read_bandwidth()
    bw = max(copy_bw, read_bw)  # the kernels mostly read: a floor they beat would say nothing
    info = dict(device=str(dev.device_kind), platform=dev.platform, jax=jax.__version__,
                copy_bandwidth_GBps=copy_bw / 1e9, read_bandwidth_GBps=read_bw / 1e9, floor_bandwidth_GBps=bw / 1e9,
                date=time.strftime("%Y-%m-%d"), host=platform.node(),
                interpret=interpret, tuning=tuning,
                commit=args.commit or source_commit())
    print(json.dumps(info), flush=True)
    t_start = time.perf_counter()
    if args.sweep:
        rows = sweep(args, bw)
    else:
        rows = []
        for op in args.ops.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                for s in (int(x) for x in args.contexts.split(",")):
                    gib = 2 * b * s * args.k * args.h * jnp.dtype(args.dtype).itemsize / 2 ** 30
                    if gib * (2 if op == "draft" else 1) > args.max_gib:  # reference scores ~ the cache again
                        print(json.dumps(dict(op=op, batch=b, context=s, skipped=f"{gib:.1f} GiB")), flush=True)
                        continue
                    rows.append(run_case(op, b, s, args, bw, tuning, interpret))
    info["wall_s"] = time.perf_counter() - t_start
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"\n{info['device']}  copy bandwidth {copy_bw / 1e9:.0f} GB/s, read {read_bw / 1e9:.0f} GB/s (floor uses "
          f"{bw / 1e9:.0f})  jax {info['jax']}  commit {info['commit']}  "
          f"{'INTERPRET MODE (timings meaningless)' if interpret else ''}")
    print("| op | batch | context | XLA ref µs | kernel µs | floor µs | ref/kernel | kernel/floor | kernel GB/s | "
          "splits | block_k | max abs err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['batch']} | {r['context']} | {r['ref_us']:.1f} | {r['kernel_us']:.1f} | "
              f"{r['floor_us']:.1f} | {r['speedup']:.2f} | {r['kernel_over_floor']:.2f} | {r['kernel_GBps']:.0f} | "
              f"{r['num_splits']} | {r['block_k']} | {r['max_abs_err']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
