"""The packed verify kernel's short-window tile (``dflash_jax.cuda.attention.packed_block_attention(short_q_len=…)``)
against its one tile of the block's length, at compact's shapes (run on a GPU machine; ``--quick`` is a CPU smoke run).

Compact's tiers at batch 64 verify windows of mostly 1–4 tokens a row, but the kernel's tile holds
``max_q_len`` (the block, 16) query positions × G heads per program, so a one-token window computes on a 64-row
tile of which 3 rows are real. With ``short_q_len`` windows that fit run a second body of the kernel with a
tile of that many positions. Each case packs ``--batch`` rows with the same window ``w`` (and one mixed case:
windows drawn from compact's batch-64 histogram, mostly short), the rows' caches ``--context`` slots long, and
times back-to-back calls (``bench_attention.time_chain``: one jitted chain, median per call) of

* ``one tile``: ``short_q_len=None`` (``KernelTuning(packed_short_q_len=None)`` in the library),
* ``short N``: ``short_q_len=N`` for each N of ``--shorts``,
* ``ragged``: ``cuda_attention.ragged_verify_attention`` with ``max_q_len = w`` (what a plain AR step's attention
  costs at w = 1: its window's K/V in the cache; a reference point, not the same operation),

all in one run, with the largest difference between the two packed outputs (the same attention, tiled apart).

    python benchmarks/bench_packed_tile.py --out results.json          # GPU, SmolLM2's heads (~1 min)
    python benchmarks/bench_packed_tile.py --quick                     # CPU, interpret mode (timings meaningless)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import time_chain  # noqa: E402
from common import source_commit  # noqa: E402
from dflash_jax.cuda import attention as cuda_attention  # noqa: E402

# Windows (tokens a row: the anchor + drafts) and their share of compact's rows at batch 64, a rough picture of
# session 26's H200 sweep (tiers of 2–8 tokens a row): the "mixed" case draws from it.
MIXED = {1: 0.35, 2: 0.2, 3: 0.15, 4: 0.1, 6: 0.08, 9: 0.06, 16: 0.06}


def _case(b: int, wins: np.ndarray, s: int, n: int, k: int, h: int, dtype, seed: int = 0):
    """(qkv [T, N+2K, H], k/v caches [B, S, K, H], cu [B+1], starts [B]): windows packed end to end, each row's
    window starting after a cache of ``s - 16`` positions."""
    rng = np.random.default_rng(seed)
    t = int(wins.sum())
    qkv = jnp.asarray(rng.standard_normal((t, n + 2 * k, h), np.float32)).astype(dtype)
    kc = jnp.asarray(rng.standard_normal((b, s, k, h), np.float32)).astype(dtype)
    vc = jnp.asarray(rng.standard_normal((b, s, k, h), np.float32)).astype(dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(wins)]), jnp.int32)
    return qkv, (kc, vc), cu, jnp.full((b,), s - 16, jnp.int32)


def run(b: int, label: str, wins: np.ndarray, args, interpret: bool) -> dict:
    n, k, h, dtype = args.n, args.k, args.h, jnp.dtype(args.dtype)
    qkv, caches, cu, starts = _case(b, wins, args.context, n, k, h, dtype)
    secs = 0.0 if interpret else args.min_seconds

    def packed(short):
        def op(qkv, cu, kc, vc, starts):
            return cuda_attention.packed_block_attention(qkv, kc, vc, cu, starts, max_q_len=args.block,
                                                         short_q_len=short, interpret=interpret)
        return time_chain(op, (qkv, cu), [caches], starts, args.calls, args.repeats, secs)

    t_one, out_one, _ = packed(None)
    row = dict(case=label, batch=b, context=args.context, tokens=int(wins.sum()), one_tile_us=t_one * 1e6)
    for short in args.shorts:
        t_short, out_short, _ = packed(short)
        row[f"short_{short}_us"] = t_short * 1e6
        row[f"short_{short}_speedup"] = t_one / t_short
        row[f"short_{short}_max_abs_diff"] = float(jnp.abs(out_short.astype(jnp.float32)
                                                           - out_one.astype(jnp.float32)).max())
    w = int(wins.max())
    if (wins == w).all():  # the ragged kernel's windows sit at the end of the cache: kv_len = start + w
        def ragged(q, cu, kc, vc, starts):
            return cuda_attention.ragged_verify_attention(q, kc, vc, cu, starts + w, max_q_len=w, interpret=interpret)
        t_rag, _, _ = time_chain(ragged, (qkv[:, :n], cu), [caches], starts, args.calls, args.repeats, secs)
        row["ragged_us"] = t_rag * 1e6
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_packed_tile.json")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--windows", default="1,2,4,8,16", help="tokens a row in the uniform cases")
    ap.add_argument("--shorts", default="4", help="short_q_len values to time against the one tile")
    ap.add_argument("--context", type=int, default=512, help="cache slots a row (the window starts 16 before)")
    ap.add_argument("--block", type=int, default=16, help="max_q_len: the verify block")
    ap.add_argument("--heads", default="9,3,64", help="N,K,H (default: SmolLM2-135M's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--calls", type=int, default=30, help="chained calls per timed program (a step's layers)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--min-seconds", type=float, default=0.3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    args = ap.parse_args()
    args.n, args.k, args.h = (int(x) for x in args.heads.split(","))
    args.shorts = [int(x) for x in args.shorts.split(",")]
    interpret = jax.default_backend() != "gpu"
    if args.quick:
        args.batches, args.windows, args.context, args.calls, args.repeats = "4", "1,16", 64, 2, 1
    elif interpret:
        print("no GPU backend: use --quick for an interpret-mode smoke run", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    info = dict(device=str(dev.device_kind), jax=jax.__version__, date=time.strftime("%Y-%m-%d"), interpret=interpret,
                heads=args.heads, block=args.block, dtype=args.dtype, shorts=args.shorts,
                commit=source_commit())
    print(json.dumps(info), flush=True)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for w in (int(x) for x in args.windows.split(",")):
            rows.append(run(b, f"{w} a row", np.full(b, w), args, interpret))
        mixed = np.random.default_rng(b).choice(list(MIXED), size=b, p=list(MIXED.values()))
        rows.append(run(b, "mixed", mixed, args, interpret))
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    shorts = " | ".join(f"short {s} µs | ×" for s in args.shorts)
    print(f"\n{info['device']}  jax {info['jax']}  commit {info['commit']}"
          f"{'  INTERPRET MODE (timings meaningless)' if interpret else ''}")
    print(f"| batch | windows | tokens | one tile µs | {shorts} | ragged µs |")
    print("|---|---|---|---|" + "---|---|" * len(args.shorts) + "---|")
    for r in rows:
        cells = " | ".join(f"{r[f'short_{s}_us']:.1f} | {r[f'short_{s}_speedup']:.2f}" for s in args.shorts)
        rag = f"{r['ragged_us']:.1f}" if "ragged_us" in r else "—"
        print(f"| {r['batch']} | {r['case']} | {r['tokens']} | {r['one_tile_us']:.1f} | {cells} | {rag} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
