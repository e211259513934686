"""Measuring a step cost table (``dflash-jax calibrate``): the time of one decode step at every packed-verify tier.

The table's type, its files and how a call picks one are in :mod:`dflash_jax.costs`.
"""

from __future__ import annotations

import dataclasses
import datetime
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.costs import CostTable, device_kind
from dflash_jax.decode import loop, schedule
from dflash_jax.engine import job as jobs
from dflash_jax.engine import programs as progs
from dflash_jax.loading import as_drafter, as_target
from dflash_jax.models.split import merge_model
from dflash_jax.settings import DecodeSettings
from dflash_jax.tuning import Tuning

ROUNDS = 3  # timed calls per tier in measure()


def measure(target, drafter, *, batches=(1, 4, 16, 32, 64, 128), block_size: int | None = None,
            context: int = 256, repeats: int = 20, pair: str = "", progress=None, time_static: bool = True,
            tuning: Tuning | None = None) -> CostTable:
    """Time one compact step (draft + packed verify of ``per_row`` tokens per row + accept + commit) at every
    tier of every batch, the scheduler's autoregressive step (no drafting), the plain autoregressive step (what
    verify mode auto falls back to) and the static verify's step, the
    rows' caches holding ``context`` tokens. One program per batch and mode (the tier is a runtime argument,
    as in the decode loop) that runs the step in a ``lax.while_loop``, as decoding does: one call's dispatch
    and the host's wait are spread over its steps instead of added to each (on a GPU they are a large part of
    a small model's step, and timing one step per call flattened the table); a step's time is the slope of a
    call's time over its steps (:func:`_timed`: calls of no step and of ``2 · (repeats // ROUNDS)`` steps,
    ``ROUNDS`` each after one warm-up), so that the call's own cost is left out. ``progress``: called
    with a line per batch; ``time_static=False`` leaves the static step out (one program less to compile);
    ``tuning``: the programs' knobs (default ``Tuning()``)."""
    target, drafter = as_target(target), as_drafter(drafter)
    drafter.config.check_target(target.config)
    block = DecodeSettings.build(target, drafter, 1, 1, block_size=block_size).block_size
    rng = np.random.default_rng(0)
    step_ms: dict[int, dict[int, float]] = {}
    ar_ms: dict[int, float] = {}
    static_ms: dict[int, float] = {}
    fallback_ms: dict[int, float] = {}
    for b in batches:
        ids = rng.integers(0, target.config.vocab_size, (b, context)).tolist()
        row = _time_compact_steps(target, drafter, ids, block, repeats, tuning)
        ar_ms[b] = row.pop(0)
        step_ms[b] = row
        fallback_ms[b] = _time_fallback_step(target, drafter, ids, block, repeats, tuning)
        if time_static:
            static_ms[b] = _time_static_step(target, drafter, ids, block, repeats, tuning)
        if progress:
            progress(f"batch {b:4d}: " + "  ".join(f"{n}/row {ms:.2f} ms" for n, ms in row.items())
                     + f"  autoregressive {ar_ms[b]:.2f} ms (plain {fallback_ms[b]:.2f} ms)"
                     + (f"  static {static_ms[b]:.2f} ms" if time_static else ""))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return CostTable(jax.default_backend(), device_kind(),
                     str(target.model.dtype), pair or target.name, block, context, step_ms,
                     f"{datetime.date.today().isoformat()} {commit}".strip(), ar_ms, static_ms, fallback_ms)


def _time_compact_steps(target, drafter, ids: list[list[int]], block: int, repeats: int,
                        tuning: Tuning | None = None) -> dict[int, float]:
    """tokens per row → ms of the compact step at each tier of ``len(ids)`` rows; 0 → the AR step's."""
    b = len(ids)
    tiers = schedule.tiers_for(b, block, (tuning or Tuning()).tiers_per_row)
    # Costs proportional to the tokens keep every tier (schedule.prune_tiers) and offer the AR step.
    proportional = CostTable("", "", "", "", block, 0, {1: {t // b: float(t) for t in tiers}}, ar_ms={1: 0.5})
    # decode=False: the steps below are timed in a program of their own
    job = jobs.make(target, drafter, ids, 4 * block, block_size=block, stop_token_ids=[], verify_mode="compact",
                    cost_table=proportional, tuning=tuning, decode=False)
    assert job.spec.tiers == tiers
    # The AR step is a branch of the compact step only where the scheduler may pick it (drafters without a
    # confidence head); it is timed for every drafter (the table's ar_ms explains when drafting pays).
    spec = dataclasses.replace(job.spec, ar_step=True)
    graphdefs = (job.target.split().static, job.drafter.split().static)

    def step(params, state, tier):
        t, d = merge_model(graphdefs[0], params[0]), merge_model(graphdefs[1], params[1])
        window = jnp.full((b,), (jnp.asarray(tiers + (b,), jnp.int32) // b - 1)[tier], jnp.int32)  # AR: 0
        return same_positions(loop.compact_step(t, d, state, spec, d.config.mask_token_id, window, tier), state)

    fn, state = _step_program(job, step)
    row = {}
    for i, size in enumerate(tiers + (0,)):  # index len(tiers): the autoregressive step
        row[size // b], state = _timed(fn, job.params, state, i, repeats)
    return row


def _time_static_step(target, drafter, ids: list[list[int]], block: int, repeats: int,
                      tuning: Tuning | None = None) -> float:
    """ms of the static verify's step (the decode loop's cycle) of ``len(ids)`` rows."""
    return _time_loop_step(target, drafter, ids, block, repeats, tuning,
                           lambda t, d, state, spec: loop.cycle(t, d, state, spec, d.config.mask_token_id))


def _time_fallback_step(target, drafter, ids: list[list[int]], block: int, repeats: int,
                        tuning: Tuning | None = None) -> float:
    """ms of a plain autoregressive step of ``len(ids)`` rows, capturing the drafter's features (the fallback's
    step, :func:`dflash_jax.decode.loop.autoregressive_step`)."""
    return _time_loop_step(target, drafter, ids, block, repeats, tuning,
                           lambda t, d, state, spec: loop.autoregressive_step(t, state, spec)[0])


def _time_loop_step(target, drafter, ids: list[list[int]], block: int, repeats: int, tuning: Tuning | None,
                    step_of) -> float:
    """ms of ``step_of(target, drafter, state, spec)`` → state on a static job's prefilled state."""
    job = jobs.make(target, drafter, ids, 4 * block, block_size=block, stop_token_ids=[], verify_mode="static",
                    tuning=tuning, decode=False)
    graphdefs = (job.target.split().static, job.drafter.split().static)

    def step(params, state, _):
        t, d = merge_model(graphdefs[0], params[0]), merge_model(graphdefs[1], params[1])
        return same_positions(step_of(t, d, state, job.spec), state)

    fn, state = _step_program(job, step)
    return _timed(fn, job.params, state, 0, repeats)[0]


def same_positions(out, state):
    """The state after a step, back at the positions before it: every timed step then writes and attends the
    same cache slots. The state is donated, so the caches are updated in place as in the decode loop (timing
    a step on a kept state would add a copy of every cache to each entry: tens of ms a step at batch 3 on a
    small CPU, which flattened the table's ratios and made the scheduler over-verify)."""
    return dataclasses.replace(out, num_new=state.num_new, anchor_pos=state.anchor_pos, done=state.done)


def _step_program(job, step):
    """(``fn(params, state, index, n)``: ``step`` run ``n`` times in one ``while_loop``, the state donated,
    compiled; the prefilled state)."""
    def steps(params, state, index, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (step(params, c[0], index), c[1] + 1),
                                  (state, jnp.zeros((), jnp.int32)))[0]

    state, _ = job.programs.prefill(*job.pre_args)
    lowered = jax.jit(steps, donate_argnums=1).lower(job.params, state, np.int32(0), np.int32(1))
    fn = progs.compile_steps(lowered, job.spec, state)  # as the decode loop compiles its steps
    return fn, state


def _timed(fn, params, state, index: int, repeats: int, clock=time.perf_counter):
    """(ms a step of program index ``index``, the state after). Each of ``ROUNDS`` rounds times a call that runs no
    step and one of 2n steps (n = ``repeats // ROUNDS``); a step costs the slope between the two calls' median
    times. A call's own cost — its dispatch, the while loop's entry, the host's wait — is paid once, not per step:
    on a GPU it is a few ms, as much as a small model's step, and spread over a few steps it added the same to
    every entry, the cheap autoregressive step's most, so that drafting read cheaper against it than it is
    (benchmarks/README.md, "Large batches"). The call without steps is short and steady, so the slope reads
    about as steadily as a call's mean step and more so than the slope between calls of n and 2n steps
    (``benchmarks/tools/calibrate_timing.py``). It is kept at no less than a fifth of the long call's mean step,
    so that a noisy pair of calls cannot make a step free. ``clock``: seconds (tests)."""
    steps = 2 * max(1, repeats // ROUNDS)
    state = jax.block_until_ready(fn(params, state, np.int32(index), np.int32(1)))
    times: dict[int, list[float]] = {0: [], steps: []}
    for _ in range(ROUNDS):
        for n in times:
            t0 = clock()
            state = jax.block_until_ready(fn(params, state, np.int32(index), np.int32(n)))
            times[n].append(clock() - t0)
    empty, full = float(np.median(times[0])), float(np.median(times[steps]))
    return 1e3 * max((full - empty) / steps, 0.2 * full / steps), state
