"""Continuous batching: more prompts than rows.

A pool of ``batch_size`` rows decodes with one compiled decode program. The loop returns to the host once
``refill_size`` rows are done (the state's ``return_at_done``); the host takes their answers, and one refill
program (:func:`dflash_jax.decode.loop.refill_fn`) prefills the next prompts straight into those rows; decoding
resumes. A static batch waits for its slowest row — a speculative batch runs as many cycles as its worst-drafted
row needs while the others sit finished —; here a finished row gets new work.

Rows never interact, so every prompt gets the tokens a batch of its own would give: greedy output is identical to
:func:`dflash_jax.generate`'s; sampled rows draw from keys of their own (other keys than a one-batch call's, the
same distribution). The public calls run a pool where ``batch_size`` is below their prompt count.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import numpy as np

from dflash_jax import sharding as shd
from dflash_jax.decode import loop
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.decode.state import DecodeView
from dflash_jax.engine import job as jobs
from dflash_jax.engine import programs as progs
from dflash_jax.loading import Drafter, Target
from dflash_jax.settings import DecodeSettings

# refill_size's default: this fraction of the pool (at least one row). Smaller refills leave fewer finished rows
# idle; each costs a return to the host and a prefill call.
REFILL_FRACTION = 1 / 8


@dataclasses.dataclass
class Answer:
    """One prompt's row of the packed view when it finished, and how long it waited for it."""

    row: list[np.ndarray]  # DecodeView's fields (its slot's row of each)
    latency_s: float  # from its prefill's dispatch to the host reading it back

    def tokens(self) -> list[int]:
        view = DecodeView(*self.row)
        return view.tokens[0, : view.num_new[0]].tolist()

    def acceptance(self) -> list[int]:
        view = DecodeView(*self.row)
        return view.acc_lens[0, : view.num_cycles[0]].tolist()


def run(target: Target, drafter: Drafter | None, ids: list[list[int]], settings: DecodeSettings, *,
        refill_size: int | None = None,
        on_finish: Callable[[list[tuple[int, list[int], list[int]]]], None] | None = None
        ) -> jobs.GenerationOutput:
    """Decode token-id prompts ``ids`` (``settings.rows``: their values) through a pool of
    ``settings.batch_size`` rows, refilled ``refill_size`` rows at a time (default ``batch_size`` ×
    :data:`REFILL_FRACTION`). ``on_finish`` is called at each return to the host with the prompts finished
    since the last: (index, new tokens, acceptance lengths). The output is in prompt order, as
    :func:`dflash_jax.speculative_generate` returns it; its stats add ``segments`` (returns to the host),
    ``refills`` (refill calls), ``cycles`` (the pool's), and ``request_latency_s`` per prompt."""
    n = len(ids)
    batch_size = settings.batch_size
    if batch_size is None:
        raise ValueError("a pool needs settings.batch_size (its rows)")
    rows = settings.rows
    max_new = rows.max_new
    lens = jobs.checked_lengths(target.config, ids, max_new)
    dp = shd.mesh_size(target.mesh, "dp")
    b = -(-min(batch_size, n) // dp) * dp
    r = refill_size if refill_size is not None else max(1, round(b * REFILL_FRACTION))
    if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or not 1 <= r <= b:
        raise ValueError(f"refill_size must be an integer in [1, batch_size={b}], got {refill_size!r}")
    r = -(-r // dp) * dp
    new_cap = jobs.bucket(int(max_new.max()))
    pool = jobs.PoolShape(new_cap, jobs.cache_length(jobs.bucket(int(lens.max())), new_cap, settings.block_size))
    first = np.arange(min(b, n))
    rest = n - len(first)
    job = jobs.prepare(target, drafter, [ids[i] for i in first], settings.with_rows(rows.take(first)),
                       pad_batch_to=b, pool=pool, return_at_done=min(r, rest) if rest else None)
    pool_run = Pool(job, b, r, rows.sampling, max_new, settings.seed)
    pool_run.compile_refills(ids, np.arange(len(first), n))  # none compiles mid-run, leaving the device idle
    t0 = time.perf_counter()
    pool_run.start(first, t0)
    answers: dict[int, Answer] = {}
    nxt = len(first)
    while True:
        view = pool_run.decode()
        finished = pool_run.harvest(view, time.perf_counter())
        answers.update(finished)
        free = np.flatnonzero(pool_run.slots < 0)
        take = min(len(free), n - nxt)
        left = n - nxt - take
        return_at = min(r, left) if left else b
        for k in range(0, take, r):  # refill calls of r rows each; the last one's return_at_done holds
            chunk = np.arange(nxt + k, nxt + min(k + r, take))
            pool_run.refill(ids, chunk, free[k: k + len(chunk)], return_at, time.perf_counter())
        nxt += take
        if on_finish is not None and finished:  # while the device runs the refills' prefills
            on_finish([(i, a.tokens(), a.acceptance()) for i, a in finished.items()])
        if len(answers) == n:
            break
    wall = time.perf_counter() - t0
    return _output(job, ids, answers, view, pool_run, wall)


class Pool:
    """The pool's device state and which prompt each row holds (-1: free)."""

    def __init__(self, job: jobs.Job, b: int, r: int, sp: SamplingParams, max_new: np.ndarray, seed: int):
        self.job, self.b, self.r, self.sp, self.max_new, self.seed = job, b, r, sp, max_new, seed
        self.slots = np.full(b, -1)
        self.admitted = np.zeros(b)
        self.cycles_seen = np.zeros(b, np.int64)
        self.state = None
        self.segments = self.refills = self.cycles = 0
        self.compile_s = job.compile_s

    def start(self, first: np.ndarray, now: float) -> None:
        self.state, _ = self.job.programs.prefill(*self.job.pre_args)
        self.slots[: len(first)] = first
        self.admitted[:] = now

    def decode(self) -> DecodeView:
        self.state, packed = self.job.decoder(self.state, jobs.ALL_CYCLES)
        view = jobs.fetch_view(self.job, packed)
        self.segments += 1
        self.cycles += int((view.num_cycles - self.cycles_seen).max())  # a row active all along saw every cycle
        self.cycles_seen = view.num_cycles.astype(np.int64)
        return view

    def harvest(self, view: DecodeView, now: float) -> dict[int, Answer]:
        """The answers of rows that finished since the last harvest; their rows become free."""
        out = {}
        columns = [getattr(view, f.name) for f in dataclasses.fields(view)]
        for slot in np.flatnonzero(view.done & (self.slots >= 0)):
            out[int(self.slots[slot])] = Answer([c[slot: slot + 1] for c in columns], now - self.admitted[slot])
            self.slots[slot] = -1
        return out

    def refill(self, ids: list[list[int]], prompts: np.ndarray, rows: np.ndarray, return_at: int, now: float):
        """Prefill ``prompts`` (indices into ``ids``, at most r) into free ``rows``; padding rows are dropped."""
        self.refills += 1
        prompt_len, args = self._refill_inputs(ids, prompts, rows, return_at)
        self.state, _ = self._refill_program(prompt_len, args)(self.job.params, self.state, *args)
        self.slots[rows] = prompts
        self.admitted[rows] = now
        self.cycles_seen[rows] = 0

    def compile_refills(self, ids: list[list[int]], queued: np.ndarray) -> None:
        """The refill program of every prompt bucket among ``queued`` (indices into ``ids``)."""
        by_bucket = {jobs.bucket(len(ids[i])): i for i in queued}
        for i in by_bucket.values():
            prompt_len, args = self._refill_inputs(ids, np.asarray([i]), np.asarray([0]), self.b)
            self._refill_program(prompt_len, args)

    def _refill_inputs(self, ids: list[list[int]], prompts: np.ndarray, rows: np.ndarray, return_at: int):
        """(prompt bucket, the refill program's inputs (ints, floats), placed as the prefill's)."""
        job, r = self.job, self.r
        chunk = [ids[i] for i in prompts]
        lens = np.asarray([len(p) for p in chunk])
        host = jobs.host_batch(chunk, lens, self.max_new[prompts], job.stops, r, job.spec.block_size,
                               jobs.PoolShape(job.host.new_cap, job.host.capacity))
        sp = None
        if job.spec.sampling:
            pad = lambda x: np.concatenate([x[prompts], np.repeat(x[prompts[-1:]], r - len(prompts))])  # noqa: E731
            sp = SamplingParams(pad(self.sp.temperature), pad(self.sp.top_k), pad(self.sp.top_p))
        seed = (self.seed + 0x9E3779B1 * self.refills) % 2**32  # each refill's rows draw from keys of their own
        ints, floats = jobs.pack_inputs(host.prompt, host.lens, host.max_new, job.host.stops, seed, sp,
                                        job.step_cost, return_at)
        ints = np.concatenate([ints, rows, np.full(r - len(rows), self.b)]).astype(np.int32)
        args = (ints, floats)
        if job.spec.plan:  # placed replicated, as the prefill's inputs (prepare)
            args = jax.device_put(args, job.spec.plan.replicated())
        return host.prompt.shape[1], args

    def _refill_program(self, prompt_len: int, args: tuple):
        job = self.job
        key = job.key + ("refill", self.r, prompt_len)

        def build():
            static = dict(capacity=job.host.capacity, batch=self.r, prompt_len=prompt_len,
                          num_stops=len(job.host.stops))
            graphdefs = (job.target.split().static, job.drafter.split().static if job.drafter else None)
            fn = jax.jit(functools.partial(loop.refill_fn, spec=job.spec, **static), static_argnums=0,
                         donate_argnums=2)
            with progs.mesh_context(job.spec):
                lowered = fn.lower(graphdefs, job.params, job.programs.prefill.out_info[0], *args)
                return lowered.compile(job.spec.tuning.compiler_options_dict())

        program, seconds = progs.CACHE.timed_get(key, build)
        self.compile_s += seconds
        return program


def _output(job: jobs.Job, ids: list[list[int]], answers: dict[int, Answer], last: DecodeView,
            pool: Pool, wall: float) -> jobs.GenerationOutput:
    """Every prompt's answer in prompt order, with the pool's statistics."""
    n = len(ids)
    rows = [answers[i].row for i in range(n)]
    columns = [np.concatenate([row[k] for row in rows]) for k in range(len(rows[0]))]
    # The tier histogram counts the pool's steps (the same in every row, kept across refills): the last view's.
    view = dataclasses.replace(DecodeView(*columns), tier_steps=np.repeat(last.tier_steps[:1], n, axis=0))
    out = jobs.collect(dataclasses.replace(job, ids=ids, compile_s=pool.compile_s), view)
    latency = [answers[i].latency_s for i in range(n)]
    out.stats.update(wall_s=wall, tokens_per_s=out.stats["new_tokens"] / max(wall, 1e-9), cycles=pool.cycles,
                     segments=pool.segments, refills=pool.refills, batch_size=pool.b, refill_size=pool.r,
                     request_latency_s=latency)
    return out
