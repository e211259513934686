"""The quickstart notebook's speed-up on this machine: its load and decode cells run as they are (the install
and plotting cells skipped), ``--runs`` times in one process, each printing the notebook's ratio (speculative ÷
autoregressive tokens/s of the second, warm call; on a CPU runtime the embedded pair).

    python benchmarks/bench_notebook.py --runs 2 --out benchmarks/results/<date>_notebook_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import jax

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cells = [''.join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    load, decode = (c for c in cells if "load_pair(" in c or "speculative_generate(target" in c)
    scope: dict = {"__name__": "notebook"}
    exec("import os\n" + load, scope)  # noqa: S102 (the project's own notebook)
    runs = []
    for _ in range(args.runs):
        exec(decode, scope)  # noqa: S102
        spec, ar = scope["spec"], scope["ar"]
        runs.append(dict(speedup=spec.stats["tokens_per_s"] / ar.stats["tokens_per_s"], tau=spec.tau,
                         verify_mode=spec.stats.get("verify_mode"), spec_tokens_per_s=spec.stats["tokens_per_s"],
                         ar_tokens_per_s=ar.stats["tokens_per_s"]))
        print(f"speed-up {runs[-1]['speedup']:.3f}x  tau {spec.tau:.2f}  ({runs[-1]['verify_mode']})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d %H:%M"), device=jax.devices()[0].device_kind, pair=scope["PAIR"],
            drafter=scope["drafter"].name, commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                                  capture_output=True, text=True).stdout.strip(),
            runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
