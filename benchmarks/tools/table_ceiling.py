"""What a cost table allows at each batch: speculative ÷ autoregressive tokens/s for a drafter whose drafts each
survive with probability 1 − p, with every row verifying the same width every step — the mean (what τ alone
says) and a whole call that waits for its slowest row (128 new tokens a row: the expected slowest of the rows'
steps, :func:`dflash_jax.engine.switching.expected_slowest`). Arithmetic on the table's step times only (no
prefill, no host work, no scheduler), so it is the ceiling a sweep's measured ratio can be read against, and the
widths that reach it.

A step of width w (w − 1 drafts and the bonus token) commits 1 + k tokens, k the drafts that survive in a row:
mean (1 − (1 − p)^w) / p. The ratio divides the autoregressive step (the table's fallback column, else its AR
column) times the tokens by the step's time.

    python benchmarks/tools/table_ceiling.py --tables tools/remote_gpu/h100_8b_tables.json --p 0.2,0.3 \\
        --out benchmarks/results/<date>_table_ceiling_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_jax.costs import CostTable  # noqa: E402
from dflash_jax.engine.switching import expected_slowest  # noqa: E402


def step_moments(p: float, width: int) -> tuple[float, float]:
    """Mean and variance of the tokens one step of ``width`` commits (drafts survive with 1 − p each)."""
    k = np.arange(1, width + 1)  # tokens committed
    prob = np.where(k < width, (1 - p) ** (k - 1) * p, (1 - p) ** (width - 1))
    mean = float((k * prob).sum())
    return mean, float((k * k * prob).sum() - mean * mean)


def ceiling(table: CostTable, batch: int, p: float, new_tokens: int) -> dict:
    ar = table.fallback_ms.get(batch) or table.ar_ms[batch]
    rows = {}
    for width, ms in sorted(table.step_ms[batch].items()):
        if width < 2:
            continue
        mean, var = step_moments(p, width)
        steps = new_tokens / mean
        sd = np.sqrt(new_tokens * var / mean ** 3)
        slowest = expected_slowest(np.full(batch, steps), np.full(batch, sd))
        rows[width] = dict(step_ms=ms, tau=mean, mean_ratio=mean * ar / ms,
                           whole_call_ratio=new_tokens * ar / (slowest * ms))
    best = max(rows, key=lambda w: rows[w]["whole_call_ratio"])
    return dict(ar_ms=ar, widths=rows, best_width=best, best_mean_ratio=max(r["mean_ratio"] for r in rows.values()),
                best_whole_call_ratio=rows[best]["whole_call_ratio"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=Path, required=True,
                    help="a cost table's JSON, or {'batches': {B: {'cost_table': …}}} as tools/remote_gpu keeps them")
    ap.add_argument("--p", default="0.2,0.3", help="the drafts' chance of failing, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    raw = json.loads(args.tables.read_text())
    tables = ([CostTable.from_json(v["cost_table"], str(args.tables)) for v in raw["batches"].values()]
              if "batches" in raw else [CostTable.from_json(raw, str(args.tables))])
    out = dict(tables=str(args.tables), new_tokens=args.new_tokens, cases=[])
    print("| p | batch | best width | ÷ AR by τ alone | ÷ AR, whole call (slowest row) |")
    print("|---|---|---|---|---|")
    for p in (float(v) for v in args.p.split(",")):
        for table in tables:
            for batch in sorted(table.step_ms):
                c = ceiling(table, batch, p, args.new_tokens)
                out["cases"].append(dict(p=p, batch=batch, device=table.device, **c))
                print(f"| {p} | {batch} | {c['best_width']} | {c['best_mean_ratio']:.2f} | "
                      f"{c['best_whole_call_ratio']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
