r"""Each call of an embedded pair's defaults timed alone: ``speculative_generate`` (verify mode ``auto``) then
``generate`` on the same prompts, ``--calls`` times in one process (the first of each compiles), with per call the
wall seconds, tokens/s, the speculative call's cycles, steps fallen back, switches and segments. What the demo's
"fastest of two calls after a first" hides: a call that drafts before the fallback has timed anything, the first
runs of each program (slow on a CPU), a probe.

    python benchmarks/tools/pair_calls.py --quantization int8 --out /tmp/int8_calls.json   # `make demo`'s prompts
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_jax import generate, load_pair, speculative_generate  # noqa: E402
from dflash_jax.cli import DEMO_PROMPTS  # noqa: E402

STATS = ("cycles", "verify_mode", "ar_fallback_steps", "fallback_switches", "fallback_segments", "compile_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--quantization", default=None, help="the target's (int8, fp8; default: as stored)")
    ap.add_argument("--max-new", type=int, default=96, help="new tokens a row (the demo's 96)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    target, drafter = load_pair(args.pair, quantization=args.quantization)
    kw = dict(max_new_tokens=args.max_new)
    calls = []
    for i in range(args.calls):
        t0 = time.perf_counter()
        sp = speculative_generate(target, drafter, DEMO_PROMPTS, **kw)
        t1 = time.perf_counter()
        ar = generate(target, DEMO_PROMPTS, **kw)
        t2 = time.perf_counter()
        row = dict(call=i, speculative_s=t1 - t0, ar_s=t2 - t1,
                   speculative_tokens_per_s=sp.stats["tokens_per_s"], ar_tokens_per_s=ar.stats["tokens_per_s"],
                   ratio=sp.stats["tokens_per_s"] / ar.stats["tokens_per_s"],
                   **{k: sp.stats.get(k) for k in STATS})
        calls.append(row)
        print(f"call {i}: speculative {row['speculative_tokens_per_s']:6.1f} tok/s ({row['speculative_s']:5.2f} s, "
              f"{row['cycles']} cycles, {row['ar_fallback_steps']} fallen back, {row['fallback_switches']} switches)"
              f"  AR {row['ar_tokens_per_s']:6.1f} tok/s  ratio {row['ratio']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(command=" ".join(["python", *sys.argv]), pair=args.pair,
                                            quantization=args.quantization, max_new=args.max_new,
                                            date=time.strftime("%Y-%m-%d %H:%M"), calls=calls), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
