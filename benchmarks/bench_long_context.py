"""End-to-end effect of the attention kernels: decoding at long context with and without them.

A SmolLM2-135M-shaped target (random bf16 weights, positions up to 40k) and a random 2-layer drafter decode
``--max-new`` tokens after a ``--context``-token prompt, once per ``attention_impl`` (XLA reference vs the
backend's kernels). Random drafter: τ = 1, so the speculative figure is the cost of one draft + verify
cycle; the AR figure is one target step. Both read the whole KV cache every step, which is what the kernels
speed up. Outputs of every implementation are compared with the first one's (token agreement).

    python benchmarks/bench_long_context.py --context 16384 --batches 1,8 --impls xla,cuda --out long.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_8B, SMOLLM2_135M, random_target, source_commit  # noqa: E402
from dflash_jax import generate, random_drafter, speculative_generate  # noqa: E402

SHAPES = {"smollm2": dataclasses.replace(SMOLLM2_135M, max_position_embeddings=40960),
          "qwen3-8b": QWEN3_8B,
          "tiny": dataclasses.replace(SMOLLM2_135M, num_layers=2, vocab_size=512, max_position_embeddings=40960)}


def run(fn, repeats: int):
    fn()  # compile
    outs = [fn() for _ in range(repeats)]
    return outs, statistics.median(o.stats["decode_s"] / o.stats["cycles"] for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--impls", default="xla,auto")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="bench_long_context.json")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    target = random_target(cfg, jnp.dtype(args.dtype))
    drafter = random_drafter(target, block_size=16, num_layers=2, dtype=args.dtype)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        rng = np.random.default_rng(b)
        prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(b)]
        kw = dict(max_new_tokens=args.max_new, stop_token_ids=[])
        first = None
        for impl in args.impls.split(","):
            ar, ar_step = run(lambda: generate(target, prompts, attention_impl=impl, **kw), args.repeats)
            sp, sp_cycle = run(lambda: speculative_generate(target, drafter, prompts, attention_impl=impl, **kw),
                               args.repeats)
            first = first or (ar[0].token_ids, sp[0].token_ids)
            agree = np.mean([x == y for a, c in zip(ar[0].token_ids, first[0]) for x, y in zip(a, c)])
            row = dict(impl=impl, batch=b, context=args.context, ar_step_ms=ar_step * 1e3,
                       spec_cycle_ms=sp_cycle * 1e3, ar_tok_s=b / ar_step, tau=sp[0].tau,
                       spec_tok_s=sp[0].tau * b / sp_cycle, ar_tokens_agree_with_first_impl=float(agree),
                       spec_equals_first_impl_spec=sp[0].token_ids == first[1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=args.shape, dtype=args.dtype,
                date=time.strftime("%Y-%m-%d"), commit=args.commit or source_commit())
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(f"\n{info['device']}  {args.shape} {args.dtype}, context {args.context}, {args.max_new} new tokens, "
          f"commit {args.commit}")
    print("| impl | batch | AR step ms | spec cycle ms | AR tok/s | spec tok/s (τ) | AR agree | spec same |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['batch']} | {r['ar_step_ms']:.2f} | {r['spec_cycle_ms']:.2f} | {r['ar_tok_s']:.0f} | "
              f"{r['spec_tok_s']:.0f} ({r['tau']:.2f}) | {r['ar_tokens_agree_with_first_impl']:.3f} | "
              f"{r['spec_equals_first_impl_spec']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
