"""Time loading the embedded SmolLM2 target in fresh processes: tokenizer cache cold, then warm.

Each load runs in its own Python process (what a CLI call, a notebook kernel or a test subprocess pays);
the cold run points ``DFLASH_JAX_CACHE`` at an empty directory. Prints one JSON line per run and a summary.

    python benchmarks/bench_load.py --repeats 3 --out load.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, time
t = time.perf_counter()
from dflash_jax.loading import load_target
t_import = time.perf_counter() - t
t = time.perf_counter()
target = load_target("smollm2-135m", dtype="float32")
print(json.dumps({"import_s": t_import, "load_s": time.perf_counter() - t}))
"""


def run(cache: str) -> dict:
    env = {**os.environ, "DFLASH_JAX_CACHE": cache, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            for state in ("cold", "warm"):  # the cold run fills the cache the warm one reads
                row = {"repeat": i, "tokenizer_cache": state, **run(cache)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = {state: min(r["load_s"] for r in rows if r["tokenizer_cache"] == state) for state in ("cold", "warm")}
    print(f"load_target('smollm2-135m') in a fresh process, best of {args.repeats}: "
          f"cold cache {summary['cold']:.2f} s, warm cache {summary['warm']:.2f} s "
          f"({summary['cold'] / summary['warm']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "best_s": summary}, f, indent=1)


if __name__ == "__main__":
    main()
