r"""Each call of an embedded pair's defaults timed alone: ``speculative_generate`` (verify mode ``auto``) then
``generate`` on the same prompts, ``--calls`` times in one process (the first of each compiles), with per call the
wall seconds, tokens/s, the speculative call's cycles, steps fallen back, switches and segments. What the demo's
"fastest of two calls after a first" hides: a call that drafts before the fallback has timed anything, the first
runs of each program (slow on a CPU), a probe.

    python benchmarks/tools/pair_calls.py --quantization int8 --out /tmp/int8_calls.json   # `make demo`'s prompts

``--force-fallback`` runs every speculative call on the fallback program alone (every segment autoregressive,
never ``generate``'s own programs): what a fallback step costs against ``generate``'s, per step of the decode
(``--fallback-steps`` sets the segments' length).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from common import fallback_log_line, source_commit  # noqa: E402

from dflash_jax import generate, load_pair, speculative_generate  # noqa: E402
from dflash_jax.cli import DEMO_PROMPTS  # noqa: E402
from dflash_jax.engine import switching  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402

STATS = ("cycles", "verify_mode", "ar_fallback_steps", "fallback_switches", "fallback_segments", "compile_s",
         "fallback_log")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--quantization", default=None, help="the target's (int8, fp8; default: as stored)")
    ap.add_argument("--max-new", type=int, default=96, help="new tokens a row (the demo's 96)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--force-fallback", action="store_true", help="every segment on the fallback program")
    ap.add_argument("--fallback-steps", type=int, default=Tuning().fallback_steps)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.force_fallback:  # a diagnostic: the policy always answers "autoregressive", and runs it in segments
        switching.SwitchPolicy.next_segment = lambda self: switching.AUTOREGRESSIVE
        switching.SwitchPolicy.skips_call = lambda self, segments: False
    target, drafter = load_pair(args.pair, quantization=args.quantization)
    kw = dict(max_new_tokens=args.max_new)
    tuning = Tuning(fallback_steps=args.fallback_steps)
    calls = []
    for i in range(args.calls):
        t0 = time.perf_counter()
        sp = speculative_generate(target, drafter, DEMO_PROMPTS, tuning=tuning, **kw)
        t1 = time.perf_counter()
        ar = generate(target, DEMO_PROMPTS, **kw)
        t2 = time.perf_counter()
        row = dict(call=i, speculative_s=t1 - t0, ar_s=t2 - t1,
                   speculative_tokens_per_s=sp.stats["tokens_per_s"], ar_tokens_per_s=ar.stats["tokens_per_s"],
                   ratio=sp.stats["tokens_per_s"] / ar.stats["tokens_per_s"],
                   speculative_decode_ms_a_step=1e3 * sp.stats["decode_s"] / max(sp.stats["cycles"], 1),
                   ar_decode_ms_a_step=1e3 * ar.stats["decode_s"] / max(ar.stats["cycles"], 1),
                   **{k: sp.stats.get(k) for k in STATS})
        calls.append(row)
        print(f"call {i}: speculative {row['speculative_tokens_per_s']:6.1f} tok/s ({row['speculative_s']:5.2f} s, "
              f"{row['cycles']} cycles, {row['ar_fallback_steps']} fallen back, {row['fallback_switches']} switches)"
              f"  AR {row['ar_tokens_per_s']:6.1f} tok/s  ratio {row['ratio']:.3f}  decode ms a step "
              f"{row['speculative_decode_ms_a_step']:.1f} / {row['ar_decode_ms_a_step']:.1f}", flush=True)
        if row["fallback_log"]:
            print(f"  (segments: {fallback_log_line(row['fallback_log'])})", flush=True)
    later = calls[1:] or calls
    fastest = min(c["speculative_decode_ms_a_step"] for c in later) / min(c["ar_decode_ms_a_step"] for c in later)
    print(f"fastest decode step after the first call, speculative ÷ AR: {fastest:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(command=" ".join(["python", *sys.argv]), pair=args.pair,
                                            quantization=args.quantization, max_new=args.max_new,
                                            force_fallback=args.force_fallback, fallback_steps=args.fallback_steps,
                                            fastest_step_ratio=fastest, device=jax.devices()[0].device_kind,
                                            commit=source_commit(), date=time.strftime("%Y-%m-%d %H:%M"),
                                            calls=calls), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
