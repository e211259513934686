"""How long the batch command spends compiling before its first dispatch, by compile-thread count.

Each thread count runs ``run_batch`` in a fresh process (cold program cache) on the same prompts and reports
the compile-ahead seconds, the whole wall time and the device idle fraction of that run.

    python benchmarks/bench_batch_compile.py --input prompts.jsonl --threads 1,8 --out bench_batch_compile.json
    python benchmarks/bench_batch_compile.py --target model.gguf --drafter drafter_dir --input prompts.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(args) -> None:
    """One measured run (in its own process, so nothing is compiled yet)."""
    import jax

    from dflash_jax import batch, load_drafter, load_pair, load_target

    if args.target:
        target = load_target(args.target, args.dtype)
        drafter = load_drafter(args.drafter, target) if args.drafter else None
    else:
        target, drafter = load_pair("smollm2-135m", dtype=args.dtype)
    batch._MAX_COMPILE_THREADS = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        s = batch.run_batch(target, drafter, args.input, Path(tmp) / "out.jsonl", batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens, progress=False)
    print(json.dumps({"threads": args.threads, "compile_s": s["compile_s"], "wall_s": s["wall_s"],
                      "device_idle_fraction": s["device_idle_fraction"], "batches": s["batches"],
                      "prompts": s["prompts"], "device": str(jax.devices()[0].device_kind)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="prompt file for dflash-jax generate (JSONL or text)")
    ap.add_argument("--target", help="target path (default: the embedded SmolLM2 pair)")
    ap.add_argument("--drafter", help="drafter directory (with --target)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=8, help="few: the compile is what is measured")
    ap.add_argument("--threads", default="1,8", help="compile-thread counts to compare")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="bench_batch_compile.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = int(args.threads)
        return child(args)
    rows = []
    for n in [int(x) for x in args.threads.split(",")]:
        cmd = [sys.executable, __file__, "--child", "--threads", str(n), "--input", args.input, "--dtype", args.dtype,
               "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens)]
        cmd += ["--target", args.target] if args.target else []
        cmd += ["--drafter", args.drafter] if args.drafter else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    base = rows[0]["compile_s"]
    meta = {"date": datetime.date.today().isoformat(), "commit": args.commit, "input": args.input,
            "batch_size": args.batch_size, "dtype": args.dtype}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\n{rows[0]['device']}  commit {args.commit}  {rows[0]['prompts']} prompts, {rows[0]['batches']} batches")
    print("| compile threads | compile s | wall s | device idle | compile speed-up |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['compile_s']:.1f} | {r['wall_s']:.1f} | {r['device_idle_fraction']:.3f} "
              f"| {base / r['compile_s']:.2f}× |")


if __name__ == "__main__":
    main()
