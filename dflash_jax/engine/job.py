"""One batch's host side: prepare → launch → collect.

:func:`prepare` buckets a batch of token-id prompts to a compiled shape, resolves its verify mode against the
cost table, fetches (or compiles once) its programs (:mod:`dflash_jax.engine.programs`) and packs its inputs;
:func:`launch` dispatches prefill and decode without waiting (JAX async dispatch), so the host can prepare the
next batch while the device decodes this one; :func:`collect` turns the final packed view into a
:class:`GenerationOutput`. Every argument was validated before, once, by :class:`~dflash_jax.settings.DecodeSettings`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import numpy as np

from dflash_jax import costs, drafters
from dflash_jax import sharding as shd
from dflash_jax.decode import verify_modes
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.decode.state import DecodeView, LoopSpec
from dflash_jax.engine import programs as progs
from dflash_jax.engine import switching
from dflash_jax.engine.programs import Programs
from dflash_jax.loading import Drafter, Target
from dflash_jax.settings import DecodeSettings, Prompt, check_prompts
from dflash_jax.tokenizer import TokenizerMissingError
from dflash_jax.tuning import Tuning

ALL_CYCLES = np.int32(np.iinfo(np.int32).max)  # decode's max_cycles for "until every row is done"


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # new tokens per prompt (a stop token is included when hit)
    texts: list[str | None]  # decoded new text (None when the target has no tokenizer)
    acceptance_lengths: list[list[int]]  # a+1 per cycle per prompt (all 1 for autoregressive decoding)
    tau: float  # mean acceptance length over all cycles of all prompts
    stats: dict[str, float]  # prefill_s, decode_s, compile_s, new_tokens, tokens_per_s, decode_tokens_per_s
    prompt_token_ids: list[list[int]]
    finish_reasons: list[str]  # "stop" (stop token) or "length" (max_new_tokens)


# --------------------------------------------------------------------------------------------------
# Buckets and tokens
# --------------------------------------------------------------------------------------------------

def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (≥ minimum) below 1024, to a multiple of 1024 above (so the default prefill
    chunk, 1024, divides every prompt bucket above it)."""
    if n <= 1024:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


def cache_length(prompt_bucket: int, new_cap: int, block_size: int) -> int:
    return -(-(prompt_bucket + new_cap + block_size) // 16) * 16


def tokenize(target: Target, prompts: Sequence[Prompt], chat: bool) -> list[list[int]]:
    """Checked prompts (:func:`dflash_jax.settings.check_prompts`) → token ids, each within the vocabulary."""
    vocab = target.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or (isinstance(p, Sequence) and p and isinstance(p[0], dict)):
            if target.tokenizer is None:
                raise TokenizerMissingError(
                    f"prompt {i} is text but target {target.name!r} was loaded without tokenizer files; "
                    "pass token ids instead")
            ids = target.tokenizer.encode(p, chat=chat)
        else:
            ids = np.asarray(p).astype(np.int64).reshape(-1)
            bad = ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5].tolist()}")
            ids = ids.tolist()
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.append(ids)
    return out


def checked_lengths(cfg, ids: list[list[int]], max_new: np.ndarray) -> np.ndarray:
    """The prompts' lengths, or ValueError where a row (with its ``max_new`` tokens) cannot fit the model."""
    lens = np.asarray([len(p) for p in ids])
    worst = lens + max_new
    if worst.max() > cfg.max_position_embeddings:
        i = int(np.argmax(worst))
        raise ValueError(f"prompt of {lens[i]} tokens + max_new_tokens {int(max_new[i])} exceeds the model's "
                         f"maximum length {cfg.max_position_embeddings}")
    return lens


# --------------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A batch's host arrays, its rows padded to the compiled batch and its lengths bucketed."""

    prompt: np.ndarray  # [B, P] int32, right-padded with 0
    lens: np.ndarray  # [B] prompt lengths (dummy rows: 1)
    max_new: np.ndarray  # [B] (dummy rows: 1, discarded)
    stops: np.ndarray  # [bucketed] stop ids, -1 padding
    new_cap: int  # bucketed largest max_new_tokens
    capacity: int  # cache length: P + new_cap + L, a multiple of 16


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """What a run over more prompts than rows (:mod:`dflash_jax.engine.pool`) fixes for all its batches: the
    compiled decode program's buffers, from every prompt of the run."""

    new_cap: int  # bucketed largest max_new_tokens
    capacity: int  # cache length for the longest prompt


def host_batch(ids: list[list[int]], lens: np.ndarray, max_new: np.ndarray, stops: tuple[int, ...], b: int,
               block_size: int, pool: PoolShape | None = None) -> HostBatch:
    """``ids`` padded to ``b`` rows (finished dummy rows: one token, one discarded new token), bucketed
    (new tokens and cache length: as ``pool`` says when given)."""
    pad = b - len(ids)
    p = bucket(int(lens.max()))
    new_cap = pool.new_cap if pool else bucket(int(max_new.max()))
    prompt = np.zeros((b, p), np.int32)
    for i, row in enumerate(ids):
        prompt[i, : len(row)] = row
    stop_arr = np.full((bucket(max(len(stops), 1), 8),), -1, np.int32)
    stop_arr[: len(stops)] = stops
    return HostBatch(prompt, np.concatenate([lens, np.ones(pad, np.int64)]).astype(np.int32),
                     np.concatenate([max_new, np.ones(pad, np.int64)]).astype(np.int32), stop_arr, new_cap,
                     pool.capacity if pool else cache_length(p, new_cap, block_size))


@dataclasses.dataclass
class Job:
    """One batch prepared on the host: shapes bucketed, programs compiled (or fetched from the cache), inputs
    on the device.

    :func:`launch` dispatches it without waiting (JAX async dispatch), so the host can prepare the next batch
    while the device decodes this one; :func:`collect` fetches the results.
    """

    target: Target
    drafter: Drafter | None
    ids: list[list[int]]  # real rows only
    stops: tuple[int, ...]
    params: tuple  # (target params, drafter params or None): the programs' first argument
    pre_args: tuple  # the prefill program's arguments
    spec: LoopSpec
    programs: Programs
    compile_s: float = 0.0
    key: tuple = ()  # the programs' cache key
    host: HostBatch | None = None
    step_cost: np.ndarray | None = None  # the scheduler's cost per tier (scheduled verify modes)
    settings: DecodeSettings | None = None
    fallback: switching.Fallback | None = None  # "auto": the costs its fallback decides with (None: not armed)
    pooled: bool = False  # rows that finish get new prompts (dflash_jax.engine.pool)
    record: switching.Record = dataclasses.field(default_factory=switching.Record)
    _decoder: switching.Decoder | None = dataclasses.field(default=None, repr=False)

    @property
    def decoder(self) -> switching.Decoder:
        """This run's decode (one per job: a switching decoder's estimate lasts the run's segments)."""
        if self._decoder is None:
            self._decoder = switching.decoder(self, self.record, self.pooled)
        return self._decoder

    @property
    def survival_width(self) -> int:
        """G: drafts per cycle whose predicted survival is summed (DSpark confidence head; else 0)."""
        return self.programs.view_widths[2]


@functools.lru_cache(maxsize=64)
def _plan(mesh, target_cfg, drafter_cfg):
    return shd.make_plan(mesh, target_cfg, drafter_cfg)


def prepare(target: Target, drafter: Drafter | None, ids: list[list[int]], settings: DecodeSettings, *,
            pad_batch_to: int | None = None, pool: PoolShape | None = None, return_at_done: int | None = None,
            decode: bool = True) -> Job:
    """Bucket one batch of token-id prompts (``settings.rows``: their per-prompt values, one each) and fetch
    or compile its programs.

    ``pad_batch_to`` adds finished dummy rows so that every batch of a run has the same compiled shape;
    ``pool`` and ``return_at_done``: the first batch of a continuous run (:mod:`dflash_jax.engine.pool`).
    ``decode=False`` compiles the prefill alone (``programs.decode`` is None: calibration times its own steps).
    Host work only, no per-parameter Python: the models' splits are cached on their handles and the
    programs are looked up by a small key.
    """
    cfg = target.config
    n = len(ids)
    rows = settings.rows
    if rows is None or len(rows) != n:
        raise ValueError(f"the settings carry {0 if rows is None else len(rows)} prompts' values for {n} prompts")
    lens = checked_lengths(cfg, ids, rows.max_new)
    sp = rows.sampling
    stops = settings.stop_token_ids
    if drafter is not None and drafter.mesh is not target.mesh:
        raise shd.ShardingError("the target and the drafter must be placed on the same mesh (load the drafter "
                                "with the target: load_drafter(..., target=target) inherits its mesh)")
    dp = shd.mesh_size(target.mesh, "dp")
    b = -(-max(n, pad_batch_to or 0) // dp) * dp  # batch rows split evenly over dp
    host = host_batch(ids, lens, rows.max_new, stops, b, settings.block_size, pool)
    sampled = settings.sampling.sampled
    resolved, fallback = resolve(checked_verify_mode(settings.verify_mode, drafter, settings.block_size), drafter, b,
                                 settings.block_size, settings.cost_table, dp, settings.tuning)
    verify_mode, tiers, step_cost, ar_step = resolved
    if b > n:  # on the host: eager device ops would compile anew for each partial batch's row count
        sp = SamplingParams(*(np.concatenate([x, np.repeat(x[-1:], b - n)]) for x in
                              (sp.temperature, sp.top_k, sp.top_p)))
    capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
    plan = _plan(target.mesh, cfg, drafter.config.layers if drafter is not None else None)
    spec = settings.loop_spec(host.new_cap, capture, plan, verify_mode, tiers, ar_step)
    if pool is not None:  # rows that finish take new prompts: no batch end to hurry towards
        spec = dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, finish_together=0.0))
    tsplit = target.split()
    dsplit = drafter.split() if drafter is not None else None
    mask_id = drafter.config.mask_token_id if drafter is not None else 0
    graphdefs = (tsplit.static, dsplit.static if dsplit else None)
    params = (tsplit.leaves, dsplit.leaves if dsplit else None)
    ints, floats = pack_inputs(host.prompt, host.lens, host.max_new, host.stops, settings.seed,
                               sp if sampled else None, step_cost, return_at_done)
    # One host-to-device copy per vector (each costs ~0.25 ms on a GPU, whatever its size). On one device the
    # compiled program takes the numpy vectors itself (its C++ path skips device_put's Python: ~0.2 ms less
    # per call on the CPU); under a mesh they are placed replicated first.
    pre_args = (params, *jax.device_put((ints, floats), spec.plan.replicated())) if spec.plan else (
        params, ints, floats)
    shapes = dict(batch=b, prompt_len=host.prompt.shape[1], num_stops=len(host.stops))
    key = (spec, host.capacity, mask_id, tuple(shapes.values()), tsplit.structure,
           dsplit.structure if dsplit else None, jax.config.jax_default_matmul_precision, decode)
    t0 = time.perf_counter()
    programs = progs.programs(key, graphdefs, params, pre_args, spec, dict(capacity=host.capacity, **shapes),
                              mask_id, decode)
    return Job(target, drafter, ids, stops, params, pre_args, spec, programs, time.perf_counter() - t0, key, host,
               step_cost, settings, fallback if decode else None, pooled=pool is not None)


def make(target: Target, drafter: Drafter | None, prompts, max_new_tokens, *, pad_batch_to: int | None = None,
         decode: bool = True, **options) -> Job:
    """Validate ``options`` (:class:`~dflash_jax.settings.SpeculativeOptions`) and ``prompts``, tokenize,
    prepare: one call's job (the streams', calibration's and tests')."""
    prompts = check_prompts(prompts)
    settings = DecodeSettings.build(target, drafter, len(prompts), max_new_tokens, **options)
    return prepare(target, drafter, tokenize(target, prompts, settings.chat_template), settings,
                   pad_batch_to=pad_batch_to, decode=decode)


# --------------------------------------------------------------------------------------------------
# Verify modes and statistics
# --------------------------------------------------------------------------------------------------

def resolve(mode, drafter: Drafter | None, batch: int, block_size: int, cost_table=None, dp: int = 1,
            tuning: Tuning | None = None) -> tuple[verify_modes.Resolved, switching.Fallback | None]:
    """The verify mode a batch runs (:func:`resolve_verify_mode`) and, where its policy falls back to
    autoregressive steps and the table says a drafted step can lose to one, the fallback's costs
    (:func:`dflash_jax.engine.switching.fallback_for`)."""
    policy = verify_modes.by_name(mode)
    has_confidence = drafter is not None and drafters.kind_of(drafter.model).has_confidence
    tuning = tuning or Tuning()
    batch_costs = verify_modes.BatchCosts(
        batch, block_size, dp, has_confidence,
        lambda: costs.resolve(cost_table, jax.default_backend(), drafter.cost_tables), tuning.tiers_per_row)
    resolved = policy.resolve(batch_costs, tuning)
    return resolved, switching.fallback_for(policy, resolved, batch_costs, tuning)


def resolve_verify_mode(mode, drafter: Drafter | None, batch: int, block_size: int, cost_table=None,
                        dp: int = 1, tuning: Tuning | None = None
                        ) -> tuple[verify_modes.VerifyMode, tuple[int, ...], np.ndarray | None, bool]:
    """(verify mode, compiled tiers, step cost per tier [+ the AR step's], AR step offered) for a batch of
    ``batch`` rows, from the cost table: the mode's (or, for ``"auto"``, the policy's) own resolution
    (:meth:`dflash_jax.decode.verify_modes.VerifyPolicy.resolve`; docs/verify-modes.md). ``mode``: a name or a
    strategy. Under a ``dp`` mesh the costs are those of a device's ``batch / dp`` rows (what each device
    runs). ``tuning``: its ``auto_compact_ratio`` steers auto. Host work only (nothing compiles)."""
    return tuple(resolve(mode, drafter, batch, block_size, cost_table, dp, tuning)[0])


def checked_verify_mode(mode, drafter: Drafter | None, block_size: int) -> verify_modes.VerifyPolicy:
    """The verify mode (or policy, still to be resolved against the cost table) this batch runs — static for
    autoregressive decoding —, or a clear error naming the choices."""
    policy = verify_modes.by_name(mode)
    if drafter is None or block_size == 1:
        return verify_modes.STATIC
    return policy


def pack_inputs(prompt: np.ndarray, lens: np.ndarray, max_new: np.ndarray, stops: np.ndarray, seed: int,
                sp: SamplingParams | None, step_cost: np.ndarray | None = None, return_at_done: int | None = None
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """The prefill's inputs as two flat vectors (see :func:`dflash_jax.decode.loop.unpack_inputs`);
    ``return_at_done`` defaults to the batch (the decode loop runs until every row is done)."""
    seed_bits = np.asarray([seed % 2**32], np.uint32).view(np.int32)
    return_at = len(lens) if return_at_done is None else return_at_done
    ints = np.concatenate([prompt.reshape(-1), lens, max_new, stops, seed_bits, [return_at]]).astype(np.int32)
    parts = ([] if sp is None else [sp.temperature, sp.top_k, sp.top_p]) + (
        [] if step_cost is None else [step_cost])
    floats = np.concatenate(parts).astype(np.float32) if parts else None
    return ints, floats


def launch(job: Job, max_cycles: int | np.integer = ALL_CYCLES):
    """Dispatch prefill + decode; returns the (not yet computed) final packed view (see :func:`collect`)."""
    state, _ = job.programs.prefill(*job.pre_args)
    return job.decoder(state, np.int32(max_cycles))[1]


def finish_reasons(token_ids: list[list[int]], stops: Sequence[int]) -> list[str]:
    stop_set = set(stops)
    return ["stop" if t and t[-1] in stop_set else "length" for t in token_ids]


def fetch_view(job: Job, packed) -> DecodeView:
    """A program's packed view on the host (one device-to-host copy; blocks until it is computed)."""
    return DecodeView.unpack(np.asarray(packed), job.programs.view_widths)


def collect(job: Job, packed, stats: dict | None = None) -> GenerationOutput:
    """A finished batch's results from its final packed view (or a :class:`DecodeView` already fetched)."""
    view = packed if isinstance(packed, DecodeView) else fetch_view(job, packed)
    n = len(job.ids)
    token_ids = [view.tokens[i, : view.num_new[i]].tolist() for i in range(n)]
    acc_lens = [view.acc_lens[i, : view.num_cycles[i]].tolist() for i in range(n)]
    tok = job.target.tokenizer
    texts = [tok.decode(t) if tok else None for t in token_ids]
    all_acc = [a for row in acc_lens for a in row]
    stats = dict(stats or {})
    stats.setdefault("compile_s", job.compile_s)
    stats["new_tokens"] = int(view.num_new[:n].sum())
    stats["cycles"] = int(view.num_cycles[:n].max(initial=0))
    if job.survival_width:  # a scoring drafter's calibration
        stats.update(drafters.survival_stats(view.survival_sum[:n], acc_lens))
    if job.spec.block_size > 1:  # what verifying cost, as the verify mode reports it
        fallback_cycles = min(job.record.row_ar_steps, int(view.num_cycles[:n].sum()))
        stats.update(job.spec.verify_mode.stats(job.spec, view, n, acc_lens, fallback_cycles))
    if job.fallback is not None:
        stats.update(job.record.stats())
    return GenerationOutput(token_ids, texts, acc_lens, float(np.mean(all_acc)) if all_acc else 0.0, stats,
                            job.ids, finish_reasons(token_ids, job.stops))


def run(job: Job) -> GenerationOutput:
    """Run prefill and decode with a sync between them (for the timing stats) and collect."""
    if job.drafter is not None and job.decoder.begin_call(int(job.host.max_new.max())):
        return _run_autoregressive(job)
    t1 = time.perf_counter()
    state, packed = job.programs.prefill(*job.pre_args)
    packed.block_until_ready()
    t2 = time.perf_counter()
    compiled_before = job.compile_s
    state, packed = job.decoder(state, ALL_CYCLES)
    view = fetch_view(job, packed)  # waits for the decode, then one device-to-host copy
    t3 = time.perf_counter()
    # A program compiled on first use inside the decode (the fallback's) counts as compile time, not decode time.
    prefill_s, decode_s = t2 - t1, t3 - t2 - (job.compile_s - compiled_before)
    out = collect(job, view, {"prefill_s": prefill_s, "decode_s": decode_s, "compile_s": job.compile_s})
    total, b = out.stats["new_tokens"], len(job.ids)
    out.stats["tokens_per_s"] = total / max(prefill_s + decode_s, 1e-9)
    out.stats["decode_tokens_per_s"] = (total - b) / max(decode_s, 1e-9)
    return out


def _run_autoregressive(job: Job) -> GenerationOutput:
    """A speculative call its fallback would run on autoregressive steps from start to end
    (:meth:`dflash_jax.engine.switching.Decoder.begin_call`), run by ``generate``'s own programs: its output
    is ``generate``'s, its stats say how many steps fell back."""
    ar = prepare(job.target, None, job.ids, job.settings.autoregressive())
    out = run(ar)
    rows = sum(len(a) for a in out.acceptance_lengths)
    job.decoder.skipped(out.stats["cycles"], rows, out.stats["decode_s"])
    out.stats.update(compile_s=job.compile_s + ar.compile_s, verify_mode=job.spec.verify_mode.name,
                     verify_tokens=rows, mean_window=1.0, **job.record.stats())
    return out
