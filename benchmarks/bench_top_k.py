r"""The top-K of a DFlash2 drafter's candidates over the whole vocabulary: XLA's TopK (``lax.top_k``, the op's
reference) against the exact two-stage chunked form (``dflash_jax.cuda.top_k.chunked_top_k``, what
``KernelTuning(top_k_chunked=True)`` runs under the GPU kernels), and the LM head with each top-K against the LM
head with DFlash's argmax, so the top-K's share of the drafting is visible.

Shapes: ``[N, V]`` logits, N = rows × block positions (``--rows``, default 16 and 1,024: batch 1 and 64 at block
16; a block of 16 drafts 15 positions, so the cycle's own rows are 15 and 960), V the vocabulary (``--vocabs``,
Qwen3's 151,936 and SmolLM2's 49,152), K = ``--k``. Cases, each a jitted ``fori_loop`` of ``--iters`` dependent
calls (one element of the input rewritten from the previous call's result, the input donated: no copy a
program), median per call over ``--reps`` runs after ``--warm-s`` of warm-up:

* ``top_k`` (``--dtypes``, the logits' dtype): ``lax.top_k``; ``chunked C`` for each C of ``--chunks`` as given
  (the last chunk padded with -inf where C does not divide V) and ``fitted C`` where the library's
  ``chunk_width(V, C)`` (the largest divisor of V in [C/2, C], no padded copy) differs; ``argmax`` (DFlash's
  reduction) for scale. Each chunked result is checked equal to ``lax.top_k``'s (``exact``).
* ``head`` (hidden ``[N, --hidden]`` and an LM head ``[--hidden, V]`` in ``--head-dtype``, float32 logits as
  ``TargetModel.logits``): the head + argmax (DFlash), the head + ``lax.top_k`` (DFlash2 today), the head +
  each chunked form, and the fused kernel (``dflash_jax.cuda.head_top_k``: the head and top-K in one launch; the
  head read once per 64 rows) with the share of its ids equal to head + ``lax.top_k``'s (its own float32 sums).

    # GPU (the Qwen3-8B head: hidden 4096)
    python benchmarks/bench_top_k.py --out $OUT/top_k.json
    # CPU smoke test (tiny shapes; its times mean nothing)
    python benchmarks/bench_top_k.py --small --out /tmp/top_k.json

The JSON is rewritten after each shape, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (dflash_jax)

from common import source_commit  # noqa: E402
from dflash_jax.cuda.head_top_k import head_top_k  # noqa: E402
from dflash_jax.cuda.top_k import chunk_width, chunked_top_k  # noqa: E402


# The fused kernel's tiles beside its defaults (128, 64, 4 warps, 3 stages): (block_v, block_d, warps, stages).
FUSED_TILES = ((256, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 4), (128, 64, 8, 4), (256, 32, 8, 3), (128, 64, 4, 5),
               (256, 64, 8, 4), (128, 32, 4, 4), (512, 32, 8, 3))


def per_call_us(fn, x, consts: tuple, iters: int, reps: int, warm_s: float) -> float:
    """Median µs of one ``fn(x, *consts)`` over ``reps`` programs of ``iters`` dependent calls: each call's input
    has its first element rewritten from the previous call's output (so no call is hoisted or dropped), and
    ``x`` is donated and handed back, so the loop works on it in place (no copy of the logits a program)."""

    def chain(x, *consts):
        def body(_, carry):
            x, acc = carry
            tick = sum(o.reshape(-1)[0].astype(jnp.float32) for o in jax.tree.leaves(fn(x, *consts)))
            x = x.at[0, 0].set(jnp.where(tick > 3e38, tick.astype(x.dtype), x[0, 0]))  # never true, not foldable
            return x, acc + tick
        return jax.lax.fori_loop(0, iters, body, (x, jnp.float32(0)))

    chain = jax.jit(chain, donate_argnums=0)
    x = jax.block_until_ready(chain(x, *consts))[0]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:  # the clocks come up after the idle compile
        x = jax.block_until_ready(chain(x, *consts))[0]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x = jax.block_until_ready(chain(x, *consts))[0]
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times) / iters


def top_k_cases(k: int, v: int, chunks: list[int]) -> dict:
    """name → (function of the logits, chunk width or None, padded)."""
    cases = {"top_k": (lambda x: jax.lax.top_k(x, k), None, False)}
    for c in chunks:
        for name, width in ((f"chunked {c}", c), (f"fitted {c}", chunk_width(v, c))):
            if width >= v or width < k or (name.startswith("fitted") and width == c):
                continue
            cases[name] = (lambda x, w=width: chunked_top_k(x, k, w), width, v % width != 0)
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--rows", default="16,1024", help="N: logits rows (batch × block positions)")
    ap.add_argument("--vocabs", default="151936,49152")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the logits' dtypes (top-K alone)")
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--hidden", type=int, default=4096, help="D of the LM head (head cases; 0: none)")
    ap.add_argument("--head-dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20, help="dependent calls per timed program")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warm-s", type=float, default=0.5)
    ap.add_argument("--fused-tiles", action="store_true",
                    help="also time the fused kernel at other tiles (block_v, block_d, warps, stages: FUSED_TILES)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.small:
        args.rows, args.vocabs, args.chunks, args.hidden = "2,16", "4099,2048", "512,1024", 64
        args.iters, args.reps, args.warm_s = 2, 1, 0.0
    rows = [int(n) for n in args.rows.split(",")]
    vocabs = [int(v) for v in args.vocabs.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    commit = source_commit()
    result = dict(command=" ".join(["python", "benchmarks/bench_top_k.py", *(sys.argv[1:] if argv is None else argv)]),
                  date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit,
                  device_kind=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  args={k: str(v) for k, v in vars(args).items()}, top_k=[], head=[])
    time_it = lambda fn, x, *consts: per_call_us(fn, x.copy(), consts, args.iters, args.reps,  # noqa: E731
                                                 args.warm_s)
    rng = np.random.default_rng(0)
    for v in vocabs:
        cases = top_k_cases(args.k, v, chunks)
        for n in rows:
            for dtype in dtypes:
                x = jnp.asarray(rng.standard_normal((n, v), np.float32)).astype(dtype)
                want = jax.jit(cases["top_k"][0])(x)
                for name, (fn, width, padded) in {**cases, "argmax": (lambda x: jnp.argmax(x, -1), None,
                                                                       False)}.items():
                    exact = None
                    if width is not None:
                        got = jax.jit(fn)(x)
                        exact = bool((got[1] == want[1]).all() and (got[0] == want[0]).all())
                    us = time_it(fn, x)
                    result["top_k"].append(dict(rows=n, vocab=v, dtype=dtype, case=name, chunk=width, padded=padded,
                                                us=us, exact=exact))
                    print(f"top-k  N {n:5d}  V {v:6d}  {dtype:8s}  {name:14s} {us:9.1f} µs"
                          + ("" if exact is None else f"  exact {exact}"), flush=True)
                del x
            if args.hidden:
                d = args.hidden
                h = jnp.asarray(rng.standard_normal((n, d), np.float32)).astype(args.head_dtype)
                w = (jnp.asarray(rng.standard_normal((d, v), np.float32)) / np.sqrt(d)).astype(args.head_dtype)
                head = lambda h, w: jnp.einsum("nd,dv->nv", h, w, preferred_element_type=jnp.float32)  # noqa: E731
                base = None
                for name, (fn, width, _) in {"argmax": (lambda x: jnp.argmax(x, -1), None, False),
                                             **cases}.items():
                    us = time_it(lambda h, w, fn=fn: fn(head(h, w)), h, w)
                    base = us if base is None else base
                    result["head"].append(dict(rows=n, vocab=v, hidden=d, dtype=args.head_dtype, case=name,
                                               chunk=width, us=us, vs_argmax=us / base))
                    print(f"head   N {n:5d}  V {v:6d}  D {d}  head + {name:14s} {us:9.1f} µs  "
                          f"({us / base:.3f}× head + argmax)", flush=True)
                # the head and top-K in one kernel (interpret mode off a GPU)
                fused = lambda h, w: head_top_k(h, w, args.k, vocab_major=False,  # noqa: E731
                                                interpret=jax.default_backend() != "gpu")
                got, want = jax.jit(fused)(h, w), jax.jit(lambda h, w: jax.lax.top_k(head(h, w), args.k))(h, w)
                same = float((got[1] == want[1]).mean())  # its own float32 sums: near-ties may order otherwise
                us = time_it(fused, h, w)
                result["head"].append(dict(rows=n, vocab=v, hidden=d, dtype=args.head_dtype, case="fused kernel",
                                           chunk=None, us=us, vs_argmax=us / base, same_ids=same))
                print(f"head   N {n:5d}  V {v:6d}  D {d}  fused head + top-K  {us:9.1f} µs  "
                      f"({us / base:.3f}× head + argmax; ids as head + top_k: {same:.4f})", flush=True)
                for bv, bd, nw, ns in FUSED_TILES if args.fused_tiles else ():
                    us = time_it(lambda h, w, t=(bv, bd, nw, ns): head_top_k(
                        h, w, args.k, vocab_major=False, block_v=t[0], block_d=t[1], num_warps=t[2],
                        num_stages=t[3], interpret=jax.default_backend() != "gpu"), h, w)
                    result["head"].append(dict(rows=n, vocab=v, hidden=d, dtype=args.head_dtype,
                                               case=f"fused kernel {bv},{bd},{nw},{ns}", chunk=None, us=us,
                                               vs_argmax=us / base))
                    print(f"head   N {n:5d}  V {v:6d}  D {d}  fused, block_v {bv} block_d {bd} warps {nw} "
                          f"stages {ns}  {us:9.1f} µs", flush=True)
                del h, w
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
