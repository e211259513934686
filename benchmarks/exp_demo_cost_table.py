"""Does a freshly timed cost table change `make demo`'s speed? The demo's prompts decoded speculatively with the
shipped table and with another (e.g. one `dflash-jax calibrate` just wrote on this machine), and autoregressively,
interleaved runs after one untimed run of each; tokens/s per run, the compact tiers' step counts and τ.

    python benchmarks/exp_demo_cost_table.py /tmp/fresh.costs.json --runs 4 --out result.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_jax import generate, load_pair, speculative_generate  # noqa: E402
from dflash_jax.cli import DEMO_PROMPTS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", type=Path, help="the other costs file")
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--max-new", type=int, default=96, help="the demo's default")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    target, drafter = load_pair(args.pair)
    kw = dict(max_new_tokens=args.max_new)
    cases = {"shipped": {}, "other": dict(cost_table=str(args.table))}
    runners = {name: (lambda extra=extra: speculative_generate(target, drafter, DEMO_PROMPTS, **kw, **extra))
               for name, extra in cases.items()}
    runners["autoregressive"] = lambda: generate(target, DEMO_PROMPTS, **kw)
    for run in runners.values():  # compile and warm up
        run()
    runs = {name: [] for name in runners}
    for _ in range(args.runs):
        for name, run in runners.items():
            out = run()
            runs[name].append(dict(tokens_per_s=out.stats["tokens_per_s"], tau=out.tau,
                                   tier_steps={str(k): v for k, v in (out.stats.get("tier_steps") or {}).items()}))
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), table=str(args.table), max_new=args.max_new,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(), runs=runs)
    for name, rs in runs.items():
        speeds = sorted(r["tokens_per_s"] for r in rs)
        print(f"{name:15s} tokens/s {', '.join(f'{s:.1f}' for s in speeds)}  (median {speeds[len(speeds) // 2]:.1f}; "
              f"tiers {rs[0]['tier_steps'] or '—'}, τ {rs[0]['tau']:.2f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
