"""Where a CPU decode step's time goes, by XLA:CPU thunk: the plain autoregressive loop's step against the compact
program's autoregressive branch (the scheduler's step without drafting), its smallest and largest drafted tiers
and the static cycle (the whole block drafted and verified), on the
embedded pair at batch ``--batch`` with ``--context`` tokens in each row's cache.

Each step runs ``--steps`` times in one ``lax.while_loop`` call (as decoding runs it) under the JAX profiler;
thunk times are summed over the profile's XLA threads (two worker threads on a 2-core machine, so the sums can
exceed the wall time) and grouped by thunk name without its numeric suffix.

    python benchmarks/tools/profile_cpu_step.py --out benchmarks/results/<date>_cpu_step_profile.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import source_commit  # noqa: E402
from dflash_jax import costs, load_pair  # noqa: E402
from dflash_jax.costs import CostTable  # noqa: E402
from dflash_jax.decode import loop  # noqa: E402
from dflash_jax.engine import job as jobs  # noqa: E402
from dflash_jax.engine import programs as progs  # noqa: E402
from dflash_jax.tuning import Tuning  # noqa: E402


def _same_positions(out, s):
    """The state after a step back at the positions before it: every step writes and attends the same slots."""
    return dataclasses.replace(out, num_new=s.num_new, anchor_pos=s.anchor_pos, done=s.done)


# The step builders below (shared by profile_gpu_step.py and count_gpu_kernels.py) return (job, step(params,
# state, tier)); ``tuning`` is the job's knobs (dflash_jax.tuning.Tuning) and ``spec_changes`` override the
# prepared LoopSpec's fields (e.g. impl="cuda"). The jobs compile the prefill only: the steps run in programs
# of their own.

def _cycle(target, drafter, ids, spec_changes: dict, *, block_size: int = 16, **options):
    """(job, step): the decode loop's cycle (``loop.cycle``) on a job prepared with ``options`` (the public
    calls' keyword arguments), whose spec, with ``spec_changes``, is the step's. Without a drafter the job is
    autoregressive (``block_size`` unused)."""
    if drafter is not None:
        options["block_size"] = block_size
    job = jobs.make(target, drafter, ids, 64, stop_token_ids=[], decode=False, **options)
    job = dataclasses.replace(job, spec=dataclasses.replace(job.spec, **spec_changes))
    graphs = (job.target.split().static, job.drafter.split().static if job.drafter is not None else None)

    def step(params, s, tier):
        t, d = loop.merge_models(graphs, params)
        return _same_positions(loop.cycle(t, d, s, job.spec, d.config.mask_token_id if d is not None else 0), s)
    return job, step


def plain_step(target, ids, *, tuning: Tuning = Tuning(), **spec_changes):
    return _cycle(target, None, ids, spec_changes, block_size=1, tuning=tuning)


def static_step(target, drafter, ids, *, tuning: Tuning = Tuning(), **spec_changes):
    return _cycle(target, drafter, ids, spec_changes, verify_mode="static", tuning=tuning)


def compact_step(target, drafter, ids, batch: int, *, ar_step: bool = True, one_tier: bool = False,
                 tuning: Tuning = Tuning(), **spec_changes):
    """Every tier compiled and, with ``ar_step``, the step without drafting (tier index K); ``one_tier``: only the
    whole-block tier (a one-branch switch: no conditional at all). The job's spec is the step's."""
    every_tier = CostTable("", "", "", "", 16, 0, {1: {n: 3.0 * n for n in (1, 2, 4, 8, 16)}}, ar_ms={1: 0.5})
    job = jobs.make(target, drafter, ids, 64, block_size=16, stop_token_ids=[], verify_mode="compact",
                    cost_table=every_tier, decode=False, tuning=tuning)
    spec = dataclasses.replace(job.spec, ar_step=ar_step, tiers=job.spec.tiers[-1:] if one_tier else job.spec.tiers,
                               **spec_changes)
    job = dataclasses.replace(job, spec=spec)
    graphs = (job.target.split().static, job.drafter.split().static)

    def step(params, s, tier):
        t, d = loop.merge_models(graphs, params)
        window = jnp.full((batch,), (jnp.asarray(spec.tiers + (batch,), jnp.int32) // batch - 1)[tier], jnp.int32)
        return _same_positions(loop.compact_step(t, d, s, spec, d.config.mask_token_id, window, tier), s)
    return job, step


def compact_cycle(target, drafter, ids, *, ar_step: bool = True, tuning: Tuning = Tuning(), **spec_changes):
    """The decode loop's compact cycle as decoding runs it: the step with the tier and windows planned at the
    end of the step before, and the plan for the next one (the scheduler included); the shipped cost table of
    this backend (without its autoregressive step where ``ar_step`` is False), so the scheduler picks the tiers
    decoding would (the ``tier`` argument is unused)."""
    table = costs.shipped_table(jax.default_backend())
    return _cycle(target, drafter, ids, spec_changes, verify_mode="compact", tuning=tuning,
                  cost_table=table if ar_step else dataclasses.replace(table, ar_ms={}))


def step_loop(job, step, tier: int):
    """(``fn(params, state, tier, n)``: ``n`` steps in one ``while_loop``, state donated; the state after a first
    call of two steps — the program compiled and run once)."""
    state, _ = job.programs.prefill(*job.pre_args)

    def run(params, state, tier, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (step(params, c[0], tier), c[1] + 1),
                                  (state, jnp.zeros((), jnp.int32)))[0]

    lowered = jax.jit(run, donate_argnums=1).lower(job.params, state, np.int32(0), np.int32(1))
    fn = progs.compile_steps(lowered, job.spec, state)  # as the decode loop compiles its steps
    return fn, jax.block_until_ready(fn(job.params, state, np.int32(tier), np.int32(2)))


def profile(job, step, tier: int, steps: int) -> dict:
    fn, state = step_loop(job, step, tier)
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(job.params, state, np.int32(tier), np.int32(steps)))
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
        jax.profiler.stop_trace()
        data = ProfileData.from_file(sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1])
        total, calls = collections.Counter(), collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLAEigen"):
                    continue
                for ev in line.events:
                    if ev.name == "ThunkExecutor::Execute" or ev.name.startswith("end: "):
                        continue
                    name = re.sub(r"\.\d+$", "", ev.name)
                    total[name] += ev.duration_ns
                    calls[name] += 1
    return dict(wall_ms=wall_ms, thunks={k: dict(ms=v / steps / 1e6, calls=calls[k] / steps)
                                         for k, v in total.most_common(12)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cases", type=lambda s: [int(i) for i in s.split(",")],
                    help="which cases, by index: 0 plain AR, 1 compact's AR branch, 2 its 1-token tier, "
                         "3 its whole-block tier, 4 the static cycle (default: all)")
    ap.add_argument("--dense", choices=["on", "off"], default="on",
                    help="off: compact's whole-block tier packs its windows as the smaller tiers do")
    ap.add_argument("--tie-cache-reads", choices=["on", "off"], default="on",
                    help="off: the drafted steps' cache reads not tied to their layers "
                         "(KernelTuning.tie_cpu_cache_reads, dflash_jax.kernels.attention.read_after)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tuning = Tuning().replace(dense_whole_blocks=args.dense == "on", tie_cpu_cache_reads=args.tie_cache_reads == "on")
    target, drafter = load_pair("smollm2-135m")
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (args.batch, args.context)).tolist()
    job, step = compact_step(target, drafter, ids, args.batch, tuning=tuning)
    k = len(job.spec.tiers)
    cases = {"plain AR step": (*plain_step(target, ids, tuning=tuning), 0), "compact: AR branch": (job, step, k),
             f"compact: tier {job.spec.tiers[0]} (1 token per row)": (job, step, 0),
             f"compact: tier {job.spec.tiers[-1]} (whole blocks)": (job, step, k - 1),
             "static cycle": (*static_step(target, drafter, ids, tuning=tuning), 0)}
    cases = {name: case for i, (name, case) in enumerate(cases.items()) if args.cases is None or i in args.cases}
    result = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=jax.devices()[0].device_kind, batch=args.batch,
                  dense=args.dense, tie_cache_reads=args.tie_cache_reads,
                  context=args.context, commit=source_commit(),
                  cases={})
    for name, (j, s, tier) in cases.items():
        r = result["cases"][name] = profile(j, s, tier, args.steps)
        print(f"== {name}: {r['wall_ms']:.1f} ms a step", flush=True)
        for thunk, t in r["thunks"].items():
            print(f"   {t['ms']:7.2f} ms  ×{t['calls']:6.1f}  {thunk}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
