"""Continuous batching (:mod:`dflash_jax.engine.pool`): throughput by refill size, and where a pool's time goes.

For each pool size and refill size, every evaluation prompt (HumanEval + MT-Bench, ``bench_schedule.py``'s file)
through one pool, autoregressive and speculative (``--modes``), after an untimed run (programs compiled): tokens/s,
the pool's cycles, returns to the host, refill calls; ``--static-batches`` adds each mode over the same prompts in
consecutive static batches of the pool's size (the baseline, in the same process). ``--breakdown`` repeats each run with a sync after every
refill and decode segment and reports the seconds in each (the syncs add their own latency: a profile, not a
throughput figure).

    python benchmarks/bench_continuous.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --batches 64 --refill-sizes 4,8,16
    python benchmarks/bench_continuous.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --batches 64 --refill-sizes 8 \
        --static-batches --modes ar,static
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import source_commit  # noqa: E402
from dflash_jax import load_drafter, load_target  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.engine import pool as pools  # noqa: E402
from dflash_jax.loading import shipped_drafter_dir  # noqa: E402
from dflash_jax.settings import DecodeSettings  # noqa: E402

PROMPTS = Path(__file__).resolve().parent / "data" / "schedule_prompts.json"


def pool_settings(target, drafter, prompts, mode: str, b: int, max_new: int) -> DecodeSettings:
    """A pool of ``b`` rows over ``prompts``: autoregressive without a drafter, else speculative with the
    drafter's trained block and verify mode ``mode``."""
    spec = {} if drafter is None else dict(block_size=drafter.config.verify_width, verify_mode=mode)
    return DecodeSettings.build(target, drafter, len(prompts), max_new, batch_size=b, **spec)


def run(target, drafter, prompts, mode: str, b: int, r: int, max_new: int, before_timed=lambda: None) -> dict:
    d = None if mode == "ar" else drafter
    settings = pool_settings(target, d, prompts, mode, b, max_new)
    pools.run(target, d, prompts, settings, refill_size=r)  # compile
    before_timed()
    t0 = time.perf_counter()
    out = pools.run(target, d, prompts, settings, refill_size=r)
    wall = time.perf_counter() - t0
    s = out.stats
    return dict(tokens_per_s=s["new_tokens"] / wall, wall_s=wall, tokens=s["new_tokens"], cycles=s["cycles"],
                segments=s["segments"], refills=s["refills"], tau=out.tau)


def static_batches(target, drafter, prompts, mode: str, b: int, max_new: int) -> dict:
    """The same prompts in consecutive batches of b (the last one partial), one call each: the pool's baseline."""
    from dflash_jax import generate, speculative_generate

    def call(batch):
        if mode == "ar":
            return generate(target, batch, max_new_tokens=max_new)
        return speculative_generate(target, drafter, batch, max_new_tokens=max_new, verify_mode=mode)

    batches = [prompts[i: i + b] for i in range(0, len(prompts), b)]
    for batch in batches:  # compile every shape
        call(batch)
    t0 = time.perf_counter()
    outs = [call(batch) for batch in batches]
    wall = time.perf_counter() - t0
    tokens = sum(o.stats["new_tokens"] for o in outs)
    cycles = sum(o.stats["cycles"] for o in outs)
    return dict(tokens_per_s=tokens / wall, wall_s=wall, tokens=tokens, cycles=cycles,
                tau=float(np.mean([a for o in outs for row in o.acceptance_lengths for a in row])))


def breakdown(target, drafter, prompts, mode: str, b: int, r: int, max_new: int) -> dict:
    """The same run with a sync after every program: seconds in decode segments and in refills."""
    spent = {"decode": 0.0, "refill": 0.0}
    pool_cls = pools.Pool
    plain_decode, plain_refill = pool_cls.decode, pool_cls.refill

    def timed(name, fn):
        def wrapper(self, *a, **k):
            jax.block_until_ready(self.state)
            t0 = time.perf_counter()
            out = fn(self, *a, **k)
            jax.block_until_ready(self.state)
            spent[name] += time.perf_counter() - t0
            return out
        return wrapper

    pool_cls.decode, pool_cls.refill = timed("decode", plain_decode), timed("refill", plain_refill)
    try:  # the timed run only (the first run compiles)
        res = run(target, drafter, prompts, mode, b, r, max_new, before_timed=lambda: spent.update(decode=0.0,
                                                                                                   refill=0.0))
    finally:
        pool_cls.decode, pool_cls.refill = plain_decode, plain_refill
    res.update({f"{k}_s": v for k, v in spent.items()})
    res["ms_per_refill"] = 1e3 * spent["refill"] / max(res["refills"], 1)
    res["ms_per_cycle_in_decode"] = 1e3 * spent["decode"] / max(res["cycles"], 1)
    return res


def profile_refill(target, drafter, prompts, b: int, r: int, max_new: int, repeats: int = 10) -> dict:
    """A refill alone: ``repeats`` refills of the same r prompts into rows 0…r-1 of a pool of b rows, each
    synced (wall ms each), then the device's kernel time per refill (JAX profiler, top kernels)."""
    from common import device_profile

    settings = pool_settings(target, drafter, prompts, "static", b, max_new)
    pools.run(target, drafter, prompts, settings, refill_size=r)  # compiles every program
    rows = settings.rows
    lens = jobs.checked_lengths(target.config, prompts, rows.max_new)
    new_cap = jobs.bucket(int(rows.max_new.max()))
    pool = jobs.PoolShape(new_cap, jobs.cache_length(jobs.bucket(int(lens.max())), new_cap, settings.block_size))
    first = np.arange(min(b, len(prompts)))
    job = jobs.prepare(target, drafter, prompts[:b], settings.with_rows(rows.take(first)), pool=pool)
    p = pools.Pool(job, b, r, rows.sampling, rows.max_new, settings.seed)
    p.start(np.arange(b), 0.0)
    longest = np.argsort([-len(x) for x in prompts])[:r]  # the largest prompt bucket

    def refills(n):
        for _ in range(n):
            p.refill(prompts, longest, np.arange(r), b, 0.0)
        jax.block_until_ready(p.state)

    refills(2)
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        refills(1)
        walls.append(1e3 * (time.perf_counter() - t0))
    kernels = device_profile(lambda: refills(repeats), "/tmp/refill_trace", per=repeats, top=15)
    return dict(refill_ms=float(np.median(walls)), prompt_lens=[len(prompts[i]) for i in longest],
                kernels=kernels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="smollm2-135m-dflash")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--refill-sizes", default="4,8,16")
    ap.add_argument("--modes", default="ar,static")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--limit", type=int, help="the first N prompts only")
    ap.add_argument("--static-batches", action="store_true",
                    help="also each mode over the same prompts in consecutive static batches of the pool's size")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--profile-refill", action="store_true", help="time and profile refills alone (first batch and "
                                                                   "refill size)")
    ap.add_argument("--out", type=Path, default=Path("continuous.json"))
    args = ap.parse_args()
    target = load_target(args.gguf or "smollm2-135m", dtype=args.dtype)
    drafter = load_drafter(shipped_drafter_dir(f"embedded:{args.drafter}"), target)
    prompts = [r["ids"] for r in json.loads(PROMPTS.read_text()) if r["set"] != "poetry"][: args.limit]
    result = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, dtype=args.dtype,
                  max_new=args.max_new, drafter=args.drafter, prompts=len(prompts),
                  commit=source_commit(),
                  runs=[])
    if args.profile_refill:
        b, r = int(args.batches.split(",")[0]), int(args.refill_sizes.split(",")[0])
        result["refill_profile"] = profile_refill(target, drafter, prompts, b, r, args.max_new)
        print(json.dumps(result["refill_profile"], indent=1)[:6000], flush=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    for b in map(int, args.batches.split(",")):
        for mode in args.modes.split(",") if args.static_batches else ():
            res = static_batches(target, drafter, prompts, mode, b, args.max_new)
            res.update(batch=b, refill_size=None, mode=f"{mode} (static batches)")
            result["runs"].append(res)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
        for r in map(int, args.refill_sizes.split(",")):
            for mode in args.modes.split(","):
                res = (breakdown if args.breakdown else run)(target, drafter, prompts, mode, b, r, args.max_new)
                res.update(batch=b, refill_size=r, mode=mode)
                result["runs"].append(res)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}),
                      flush=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
