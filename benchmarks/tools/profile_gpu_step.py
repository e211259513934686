"""Where a GPU decode step's time goes: the plain autoregressive loop's step, the compact program's autoregressive
branch (the scheduler's step without drafting), each of its drafted tiers, and the static verify's cycle, on the
embedded pair at each batch of ``--batches`` with ``--context`` tokens in every row's cache.

Each step runs ``--steps`` times in one ``lax.while_loop`` call (as decoding runs it): the wall time per step from
an unprofiled call, then the same call under the JAX profiler for the device's kernel time and kernel count per
step and the top kernels (:func:`common.device_profile`). On a launch-bound step, wall − kernel time is the GPU
waiting between kernels.

    python benchmarks/tools/profile_gpu_step.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --batches 64,128 \\
        --out benchmarks/results/<date>_gpu_step_profile_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, bench_schedule
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_kernel_switches, apply_kernel_switches, device_profile, source_commit  # noqa: E402
from profile_cpu_step import compact_cycle, compact_step, plain_step, static_step, step_loop  # noqa: E402

from dflash_jax import load_drafter, load_target  # noqa: E402
from dflash_jax.loading import shipped_drafter_dir  # noqa: E402


def timed_loop(job, step, tier: int, steps: int, repeats: int, trace_dir: str, top: int = 30) -> dict:
    """Wall ms per step (median of ``repeats`` unprofiled calls) and the profiled call's kernels per step (the
    ``top`` longest)."""
    fn, state = step_loop(job, step, tier)
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(job.params, state, np.int32(tier), np.int32(steps)))
        walls.append((time.perf_counter() - t0) / steps * 1e3)
    holder = {}

    def profiled():
        holder["s"] = jax.block_until_ready(fn(job.params, state, np.int32(tier), np.int32(steps)))
    prof = device_profile(profiled, trace_dir, per=steps, top=top)
    lanes = {name: p for name, p in prof.items() if p["total_us"] > 0}
    busy = max(lanes, key=lambda name: lanes[name]["total_us"]) if lanes else None
    top = lanes[busy] if busy else dict(total_us=0.0, calls=0.0, top=[])
    # The busiest timeline only (others may repeat its kernels), but every timeline's totals too: kernels of a
    # compact step's loop body (its cache write) land on another one.
    return dict(wall_ms=float(np.median(walls)), walls_ms=walls, kernel_ms=top["total_us"] / 1e3,
                kernels=top["calls"], top=top["top"], lane=busy,
                lanes={name: dict(kernel_ms=p["total_us"] / 1e3, kernels=p["calls"]) for name, p in lanes.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="the SmolLM2 GGUF (default: the embedded one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="smollm2-135m-dflash")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="ar,compact-ar,compact-tiers,static",
                    help="ar, compact-ar, compact-tiers, compact-noar, compact-one-tier, compact-cycle (the "
                         "decode loop's cycle with its scheduler, the library's cost table, no AR offer), static")
    ap.add_argument("--tiers", help="compact-tiers: only these tier indices (e.g. 0,-1; default: every tier)")
    add_kernel_switches(ap)
    ap.add_argument("--dense", choices=["on", "off"], default="on",
                    help="off: compact's whole-block tier packs its windows as the smaller tiers do (the layout "
                         "before dflash_jax.kernels.packed.PackedLayout's dense form; "
                         "KernelTuning.dense_whole_blocks)")
    ap.add_argument("--top", type=int, default=30, help="kernels listed per case in --out")
    ap.add_argument("--keep-traces", type=Path, help="copy each case's Perfetto trace (host and device "
                    "timelines) into this folder")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tuning, switches = apply_kernel_switches(args, dense_whole_blocks=args.dense == "on")
    target = load_target(args.gguf or "smollm2-135m", dtype=args.dtype)
    drafter = load_drafter(shipped_drafter_dir(f"embedded:{args.drafter}"), target)
    wanted = set(args.cases.split(","))
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=jax.devices()[0].device_kind, dtype=args.dtype,
                  xla_flags=os.environ.get("XLA_FLAGS", ""), **switches, dense=args.dense,
                  context=args.context, steps=args.steps, drafter=args.drafter,
                  commit=source_commit(),
                  batches={})
    for batch in (int(b) for b in args.batches.split(",")):
        ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, args.context)).tolist()
        cases = {}
        if "ar" in wanted:
            cases["plain AR step"] = (*plain_step(target, ids, tuning=tuning), 0)
        if wanted & {"compact-ar", "compact-tiers"}:
            job, step = compact_step(target, drafter, ids, batch, tuning=tuning)
            k = len(job.spec.tiers)
            if "compact-ar" in wanted:
                cases["compact: AR branch"] = (job, step, k)
            if "compact-tiers" in wanted:
                picked = [int(i) % k for i in args.tiers.split(",")] if args.tiers else range(k)
                for i in picked:
                    size = job.spec.tiers[i]
                    cases[f"compact: tier {size} ({size // batch} per row)"] = (job, step, i)
        if "compact-noar" in wanted:
            job, step = compact_step(target, drafter, ids, batch, ar_step=False, tuning=tuning)
            k = len(job.spec.tiers)
            for i in ([int(i) % k for i in args.tiers.split(",")] if args.tiers else range(k)):
                cases[f"compact, no AR offer: tier {job.spec.tiers[i]}"] = (job, step, i)
        if "compact-one-tier" in wanted:
            job, step = compact_step(target, drafter, ids, batch, ar_step=False, one_tier=True,
                                     tuning=tuning)
            cases[f"compact, whole-block tier only (no conditional): {job.spec.tiers[-1]}"] = (job, step, 0)
        if "compact-cycle" in wanted:
            # No AR offer: on random ids the counts soon say drafting does not pay, and the cycle would profile
            # compact's autoregressive branch; without it the scheduler picks (small) drafted tiers.
            cases["compact cycle (scheduler included, no AR offer)"] = (
                *compact_cycle(target, drafter, ids, ar_step=False, tuning=tuning), 0)
        if "static" in wanted:
            cases["static cycle"] = (*static_step(target, drafter, ids, tuning=tuning), 0)
        out = result["batches"][batch] = {}
        for name, (job, step, tier) in cases.items():
            with tempfile.TemporaryDirectory() as trace_dir:
                r = out[name] = timed_loop(job, step, tier, args.steps, args.repeats, trace_dir, args.top)
                if args.keep_traces:
                    args.keep_traces.mkdir(parents=True, exist_ok=True)
                    trace = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))[-1]
                    label = re.sub(r"[^a-z0-9]+", "_", name.lower())
                    shutil.copy(trace, args.keep_traces / f"b{batch}_{label}.json.gz")
            print(f"== b{batch} {name}: wall {r['wall_ms']:.3f} ms a step, kernels {r['kernel_ms']:.3f} ms in "
                  f"{r['kernels']:.0f} launches", flush=True)
            for lane, p in r["lanes"].items():
                if lane != r["lane"]:
                    print(f"    (timeline {lane}: {p['kernel_ms']:.3f} ms in {p['kernels']:.0f} launches)", flush=True)
            for kern in r["top"][:12]:
                print(f"    {kern['us']:8.1f} µs  ×{kern['calls']:6.1f}  {kern['name']}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
