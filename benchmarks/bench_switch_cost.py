"""What a switch between verify mode ``"auto"``'s two programs costs: a scripted sequence of segments (drafted
and autoregressive, of set lengths) on the Qwen3-8B shape with a scripted drafter, each segment's wall ms per step
as the switching decoder times it (from its dispatch to its counts on the host).

The policy (:class:`dflash_jax.engine.switching.SwitchPolicy`) reads these walls: a drafted segment that follows
the fallback's program, or the call's prefill, may carry more than its steps (a first run after another program),
and a probe of one step carries all of it. Here each segment of the script is timed in three warm calls, so that
a segment's cost after a switch can be read against the same segment after one of its own kind. The untimed first
call's segments are timed and printed too, each drafted one with the tiers it ran for the first time in the
process: on the 8B shape a tier's first run cost nothing extra, the drafted program's first run after the
fallback's first run ~50 ms (benchmarks/journal/RESULTS.md, session 44).

    python benchmarks/bench_switch_cost.py --batch 128 --out /tmp/switch.json
    python benchmarks/bench_switch_cost.py --small --batch 8 --out /tmp/switch_small.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compact_scaled as shaped  # noqa: E402
from common import random_target, source_commit  # noqa: E402
from dflash_jax import costs, generate, speculative_generate  # noqa: E402
from dflash_jax.engine import programs as progs, switching  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402

# (segment, steps): d = drafted, a = the fallback's autoregressive program. Drafted after drafted, after the
# fallback, after the prefill; the fallback after drafted and after itself.
SCRIPT = "d1 d1 d4 d4 a32 a32 d1 d4 a8 d4 d1 a32"


class ScriptedPolicy(switching.SwitchPolicy):
    """Runs :data:`SCRIPT`'s segments in order, then the fallback to the end; observes nothing."""

    script: list[tuple[str, int]] = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.todo = list(self.script)

    def next_segment(self) -> str:
        self.probing = False
        kind, n = self.todo.pop(0) if self.todo else ("a", self.fallback_steps)
        if kind == "d":
            self.cycles, self.checking = n, False
            return switching.DRAFT
        self.checking = n != self.fallback_steps  # the decoder's short segment: ar_check_steps long
        return switching.AUTOREGRESSIVE

    def drafted(self, *args, **kw) -> None:
        pass

    def fell_back(self, wall_ms) -> None:
        pass

    def skips_call(self, segments: int) -> bool:
        return False

    def resume(self, snap) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="a tiny version of the shape (a CPU smoke test)")
    ap.add_argument("--script", default=SCRIPT, help="segments: d<steps> drafted, a<steps> autoregressive "
                                                     "(a8: the short check segment; a32: the fallback's)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls after an untimed one")
    ap.add_argument("--corrupt", type=float, default=0.3)
    ap.add_argument("--cost-table", type=Path,
                    help="a costs file or bench_compact_scaled.py's JSON (else the batch's table is timed)")
    ap.add_argument("--host-tier-switch", choices=["on", "off"], default="on",
                    help="off: the compact tier switch as a CUDA-graph conditional node (Tuning.host_tier_switch)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    script = [(s[0], int(s[1:])) for s in args.script.split()]
    ScriptedPolicy.script = script
    switching.SwitchPolicy = ScriptedPolicy  # what switching.decoder() builds
    cfg = shaped.SMALL if args.small else shaped.QWEN3_8B
    target = random_target(cfg, jnp.bfloat16)
    shaped.make_predictable(target)
    rng = np.random.default_rng(args.batch)
    prompts = rng.integers(0, target.config.vocab_size, (args.batch, 128)).tolist()
    kw = dict(max_new_tokens=128, stop_token_ids=[])
    ar = generate(target, prompts, **kw)
    drafter = shaped.known_drafter(target, prompts, ar.token_ids, layers=5, block=16, corrupt=args.corrupt)
    table = shaped.earlier_table([args.cost_table], args.batch) if args.cost_table else None
    table = table or shaped.calibrate.measure(target, drafter, batches=(args.batch,), block_size=16, context=192,
                                              pair="shaped", time_static=True)

    tuning = Tuning(host_tier_switch=args.host_tier_switch == "on")

    def call():
        return speculative_generate(target, drafter, prompts, verify_mode="auto", cost_table=table, block_size=16,
                                    tuning=tuning, **kw)

    ran: set = set()  # the tiers (verified tokens) any drafted segment of this process has run

    def logged(out) -> list:
        entries = []
        for e in out.stats["fallback_log"]:
            tiers = e.get("tiers") or {}  # tiers: which branch
            new = sorted(int(t) for t in tiers if int(t) not in ran)
            ran.update(int(t) for t in tiers)
            entries.append((e["segment"], e["steps"], e["wall_ms"], tiers, new))
        return entries

    class TimeEverything(set):
        """The decoder times a program's segments from its second call in the process; here the first call's too."""

        def __contains__(self, key) -> bool:
            return True

    progs.CACHE.warm = TimeEverything(progs.CACHE.warm)
    first = logged(call())
    print(f"batch {args.batch}, first call (its first drafted segment compiles): wall ms per step, tiers first run")
    for kind, n, wall, tiers, new in first:
        print(f"  {kind:14s} ×{n:<3d} " + ("  -   " if wall is None else f"{wall:8.2f}")
              + (f"   tiers {dict(tiers)} new {new}" if tiers else ""), flush=True)
    rows = []
    for _ in range(args.calls):
        entries = logged(call())
        rows.append([e[:4] for e in entries])
        later = [(i, e[4]) for i, e in enumerate(entries) if e[4]]
        if later:
            print(f"  a timed call ran tiers for the first time: segment(s) {later}", flush=True)
    print(f"batch {args.batch}: wall ms per step, {args.calls} calls (segment after what)")
    before = "prefill"
    summary = []
    for i, (kind, n) in enumerate(script):
        walls = [r[i][2] for r in rows if i < len(r)]
        tiers = [r[i][3] for r in rows if i < len(r)]
        name = f"{'drafted' if kind == 'd' else 'fallback'} ×{n}"
        med = float(np.median([w for w in walls if w is not None])) if any(w is not None for w in walls) else None
        summary.append(dict(segment=name, after=before, wall_ms_per_step=walls, tiers=tiers, median=med,
                            median_segment_ms=None if med is None else med * n))
        print(f"  {name:14s} after {before:14s} " + "  ".join("  -   " if w is None else f"{w:6.2f}" for w in walls)
              + ("" if med is None else f"   (segment {med * n:7.1f} ms)"), flush=True)
        before = name
    device = jax.devices()[0]
    args.out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M"), commit=source_commit(),
                                        device=getattr(device, "device_kind", str(device)),
                                        platform=platform.platform(), batch=args.batch, small=args.small,
                                        script=args.script, host_tier_switch=args.host_tier_switch,
                                        segments=summary, calls=rows, first_call=first), indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
