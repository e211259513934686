"""Host time of `generation.prepare` for full and partial batches (the batch command's per-batch host work).

A partial batch is padded to the run's batch size; if the padding ran eager device ops, each new row count
would compile small XLA programs between two batches. Embedded pair, prompts of 40 tokens, batch 32.

    python benchmarks/bench_prepare.py --out prepare.json
"""

from __future__ import annotations

import argparse
import json
import time

from dflash_jax import generation
from dflash_jax.loading import load_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,32,20,20,13", help="real rows of each timed batch, in order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target, drafter = load_pair("smollm2-135m")
    kw = dict(max_new_tokens=64, block_size=16, pad_batch_to=32)
    ids = [[1] * 40] * 32
    generation.prepare(target, drafter, ids, **kw)  # compiles the programs, once
    rows = []
    for n in (int(x) for x in args.rows.split(",")):
        t = time.perf_counter()
        generation.prepare(target, drafter, ids[:n], **kw)
        rows.append({"real_rows": n, "prepare_s": time.perf_counter() - t})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
