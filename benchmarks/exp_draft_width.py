"""Can a DFlash drafter draft a shorter block when the scheduler will verify only a few drafts?

A block-diffusion drafter attends across its whole block of mask tokens, so drafting w + 1 positions instead of
the trained L changes the first w drafts. Drafting fewer positions would cut the drafter's cost where it is real
time (large batches on large drafters); this measures what it does to the drafts: τ of the static verify with a
block of w + 1 against the full block's acceptance lengths capped at w + 1 (what verifying only the first w drafts
of a full block accepts). Greedy, float32, the embedded DFlash pair, evaluation prompts spread over the sets.

    python benchmarks/exp_draft_width.py --prompts 24 --out benchmarks/results/<date>_draft_width_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_schedule import DEFAULT_PROMPTS  # noqa: E402

from dflash_jax import load_drafter, load_target, speculative_generate  # noqa: E402
from dflash_jax.loading import _ASSETS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24, help="evaluation prompts, evenly spaced over the file")
    ap.add_argument("--blocks", default="2,3,5,9", help="shorter block sizes to draft")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = json.loads(DEFAULT_PROMPTS.read_text())
    prompts = [r["ids"] for r in rows[:: max(1, len(rows) // args.prompts)][: args.prompts]]
    target = load_target("smollm2-135m", dtype="float32")
    drafter = load_drafter(_ASSETS / "smollm2-135m-dflash", target)
    full_size = drafter.config.block_size

    def run(block: int):
        t0 = time.perf_counter()
        out = speculative_generate(target, drafter, prompts, max_new_tokens=args.max_new, block_size=block,
                                   verify_mode="static")
        return out, np.concatenate([np.asarray(r) for r in out.acceptance_lengths]), time.perf_counter() - t0

    full, full_lens, secs = run(full_size)
    print(f"block {full_size:2d}: τ {full_lens.mean():.3f}  ({secs:.0f} s)", flush=True)
    result = dict(date=time.strftime("%Y-%m-%d"), dtype="float32", prompts=len(prompts), max_new=args.max_new,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
                  full_block=dict(block=full_size, tau=float(full_lens.mean())), shorter={})
    for block in (int(b) for b in args.blocks.split(",")):
        out, lens, secs = run(block)
        capped = float(np.minimum(full_lens, block).mean())
        same = out.token_ids == full.token_ids  # lossless: it must be
        result["shorter"][block] = dict(tau=float(lens.mean()), full_block_capped=capped,
                                        ratio=float(lens.mean() / capped), same_tokens=same)
        print(f"block {block:2d}: τ {lens.mean():.3f}  the full block's capped at {block}: {capped:.3f}  "
              f"({lens.mean() / capped:.2f}×; same tokens {same}; {secs:.0f} s)", flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
