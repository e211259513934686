"""The embedded pairs' greedy output in every verify mode: a refactor's check that nothing changed for users.

For both embedded pairs (DFlash and DSpark drafters of SmolLM2-135M, float32 on the CPU) and four prompts,
records the autoregressive tokens and, per verify mode (static, compact, cap-accept, auto), the speculative
tokens and every row's acceptance lengths (equal acceptance lengths mean the scheduler made the same choices).
Run it on the tree before a change and after, then compare:

    python benchmarks/tools/record_tokens.py /tmp/before.json                 # on the old tree
    python benchmarks/tools/record_tokens.py /tmp/after.json --compare /tmp/before.json

About two minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from dflash_jax import generate, load_pair, speculative_generate  # noqa: E402

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What is the capital of France? Answer in one sentence.",
           "Explain what a hash table is to a ten-year-old.",
           "List three prime numbers larger than 100."]
MODES = ("static", "compact", "cap-accept", "auto")


def record(max_new: int) -> dict:
    out = {}
    for pair in ("smollm2-135m", "smollm2-135m-dspark"):
        target, drafter = load_pair(pair)
        out[f"{pair}/ar"] = generate(target, PROMPTS, max_new).token_ids
        for mode in MODES:
            t0 = time.time()
            r = speculative_generate(target, drafter, PROMPTS, max_new, verify_mode=mode)
            out[f"{pair}/{mode}"] = r.token_ids
            out[f"{pair}/{mode}/acc"] = r.acceptance_lengths
            print(f"{pair:20s} {mode:10s} same as AR: {r.token_ids == out[f'{pair}/ar']}  tau {r.tau:.3f}  "
                  f"ran {r.stats.get('verify_mode')}  {time.time() - t0:.1f} s", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--compare", type=Path, help="an earlier run's JSON: report every entry that differs")
    ap.add_argument("--max-new", type=int, default=48)
    args = ap.parse_args()
    out = record(args.max_new)
    args.out.write_text(json.dumps(out))
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = sorted(k for k in before.keys() | out.keys() if before.get(k) != out.get(k))
        print(f"{len(out)} entries, {'identical' if not differ else 'different: ' + ', '.join(differ)}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
