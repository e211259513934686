"""Time `dflash-jax generate` in fresh processes with the on-disk compile cache cold, warm, and turned off.

The README's batch example (embedded pair, 5 prompts, 64 new tokens, batch 4) runs as a CLI subprocess:
first with ``DFLASH_JAX_CACHE`` pointing at an empty directory (everything compiles and is written), then
again with the same directory (the programs are loaded), then with ``--no-compile-cache``. Reports each
process's wall time and the summary's ``compile_s``, and checks that the three outputs are token-identical.

    python benchmarks/bench_compile_cache.py --out compile_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    {"id": "capital", "prompt": "What is the capital of Japan? One sentence."},
    {"id": "haiku", "prompt": "Write a haiku about autumn leaves."},
    {"id": "code", "prompt": "Write a Python function that reverses a string."},
    {"id": "chat", "messages": [{"role": "user", "content": "Give me one tip for better sleep."}]},
    {"id": "ids", "token_ids": [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]},
]


def run(work: Path, name: str, cache: Path, extra: list[str], max_new_tokens: int) -> dict:
    out = work / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "dflash_jax.cli", "generate", "--config", "smollm2-135m", "--input",
           str(work / "prompts.jsonl"), "--output", str(out), "--max-new-tokens", str(max_new_tokens),
           "--batch-size", "4", "--no-progress", "--no-speedup-estimate", *extra]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(DFLASH_JAX_CACHE=str(cache), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t
    summary = json.loads(Path(str(out) + ".summary.json").read_text())
    tokens = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    xla = cache / "xla"
    return {"run": name, "process_wall_s": wall, "compile_s": summary["compile_s"], "tokens": tokens,
            "cache_entries": len(list(xla.glob("*-cache"))) if xla.is_dir() else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        cache = work / "cache"
        rows = [run(work, "cold", cache, [], args.max_new_tokens),
                run(work, "warm", cache, [], args.max_new_tokens),
                run(work, "off", work / "cache_off", ["--no-compile-cache"], args.max_new_tokens)]
    identical = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    for r in rows:
        r.pop("tokens")
        print(json.dumps(r))
    print(f"cold {rows[0]['compile_s']:.2f} s compile / {rows[0]['process_wall_s']:.1f} s process, "
          f"warm {rows[1]['compile_s']:.2f} s / {rows[1]['process_wall_s']:.1f} s, "
          f"off {rows[2]['compile_s']:.2f} s / {rows[2]['process_wall_s']:.1f} s; outputs identical: {identical}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "identical": identical}, indent=1))
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
