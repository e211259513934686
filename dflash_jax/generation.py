"""Public generation API: :func:`speculative_generate` and the autoregressive baseline :func:`generate`.

Host side only: validate and tokenize prompts, pick shape buckets, fetch (or compile once) the prefill and
decode programs, run them, and turn the final :class:`DecodeState` into Python lists. All device work is in
:mod:`dflash_jax.decode.loop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import costs, drafters
from dflash_jax.cuda import graphs
from dflash_jax.decode import loop, verify_modes
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.decode.state import DecodeView, LoopSpec
from dflash_jax.kernels import resolve_impl
from dflash_jax.loading import Drafter, Target, as_drafter, as_target
from dflash_jax.tokenizer import TokenizerMissingError
from dflash_jax.tuning import Tuning

Prompt = str | Sequence[int] | Sequence[dict]


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
# Compiled programs: one (prefill, decode) pair per (static settings, model structures, argument shapes).
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Programs:
    prefill: Any  # (params, ints, floats) → (state, packed view)
    decode: Any  # (params, state, max_cycles) → (state, packed view); the state is donated (None: not compiled)
    view_widths: tuple[int, ...]  # the packed view's columns (DecodeView.unpack)


_PROGRAMS: dict[tuple, Programs] = {}
_COMPILE_COUNT = 0
# XLA options for compiling the prefill and decode programs (``Lowered.compile(compiler_options=...)``);
# None = XLA's defaults. The test suite lowers the CPU backend's optimisation for its tiny models, where
# compiling dominates and running is instant. Programs already compiled are kept whatever this is later set to.
COMPILER_OPTIONS: dict[str, Any] | None = None
ALL_CYCLES = np.int32(np.iinfo(np.int32).max)  # decode's max_cycles for "until every row is done"
# On a GPU, a compact loop that plans its steps ahead (``loop.plans_ahead``) runs its tier switch from the host
# instead of as a CUDA-graph conditional node (``cuda.graphs``); False keeps XLA's conditional node (A/B runs;
# part of the program cache's key, :func:`trace_switches`).
HOST_TIER_SWITCH = True


def trace_switches() -> tuple:
    """The module switches that change what a program traces to or how it compiles (benchmarks' A/B runs set
    them between calls): part of the program cache's key, so flipping one compiles afresh."""
    return (HOST_TIER_SWITCH, loop.SEQUENTIAL_DRAFT_CAP)


def decode_compiler_options(spec: LoopSpec, state_info) -> dict[str, Any] | None:
    """:data:`COMPILER_OPTIONS` for a program that runs compact steps on the state ``state_info`` (a state or its
    shapes), with the tier switch off the CUDA graphs where the step's tier is planned ahead on a GPU."""
    if not (HOST_TIER_SWITCH and jax.default_backend() == "gpu" and loop.plans_ahead(state_info, spec)):
        return COMPILER_OPTIONS
    return {**(COMPILER_OPTIONS or {}), **graphs.without_conditional_nodes()} or None


def compile_steps(lowered: jax.stages.Lowered, spec: LoopSpec, state_info) -> jax.stages.Compiled:
    """``lowered`` (a program running decode steps on ``state_info``) compiled with
    :func:`decode_compiler_options`, or with :data:`COMPILER_OPTIONS` should this XLA refuse those."""
    options = decode_compiler_options(spec, state_info)
    try:
        return lowered.compile(options)
    except Exception:  # noqa: BLE001 — e.g. an XLA that names its command-buffer types otherwise
        if options is COMPILER_OPTIONS:
            raise
        return lowered.compile(COMPILER_OPTIONS)


def compile_count() -> int:
    """How many programs this process has compiled (tests use it to prove there are no recompiles)."""
    return _COMPILE_COUNT


def count_compiles(k: int) -> None:
    global _COMPILE_COUNT
    _COMPILE_COUNT += k


def _programs(key: tuple, graphdefs: tuple, params: tuple, pre_args: tuple, spec: LoopSpec, static: dict,
              mask_id: int, decode: bool = True) -> Programs:
    """The cached programs for ``key`` (small and cheap to hash: the model structures enter as the integers
    of :class:`~dflash_jax.loading.SplitModel`), compiled on first use; the prefill alone without ``decode``."""
    programs = _PROGRAMS.get(key)
    if programs is None:
        # Trace under our (auto-axes) mesh, whatever mesh context the caller is in (e.g. an explicit one).
        with jax.set_mesh(spec.plan.mesh) if spec.plan else contextlib.nullcontext():
            pre = jax.jit(functools.partial(loop.prefill_fn, spec=spec, **static),
                          static_argnums=0).lower(graphdefs, *pre_args).compile(COMPILER_OPTIONS)
            dec = None
            if decode:
                lowered = jax.jit(functools.partial(loop.decode_fn, spec=spec, mask_token_id=mask_id),
                                  static_argnums=0, donate_argnums=2).lower(graphdefs, params, pre.out_info[0],
                                                                           jax.ShapeDtypeStruct((), jnp.int32))
                dec = compile_steps(lowered, spec, pre.out_info[0])
        programs = _PROGRAMS[key] = Programs(pre, dec, DecodeView.widths(pre.out_info[0]))
        count_compiles(1 + decode)
    return programs


# --------------------------------------------------------------------------------------------------
# Buckets and validation
# --------------------------------------------------------------------------------------------------

# verify_mode="auto" runs compact where the cost table times the static verify's step: compact then runs
# static's program itself wherever none of its tiers saves on that step (resolve_verify_mode), and on the H200
# it is at least static's speed at every batch 1–128 (benchmarks/RESULTS.md, 2026-12-05 session 21: 1.01–1.39×
# static). A table without static's step (measured before it was timed) falls back to a ratio: compact where the
# whole-block step costs at least this many times the one-token-per-row step — where verifying fewer tokens
# cannot save more than that, compact's fixed costs (the scheduler, its conditionals) eat the saving (RESULTS
# 2026-12-02 and 2026-12-04; on a 2-core CPU, ratio ~2, compact wins from batch 3).
# $DFLASH_JAX_AUTO_COMPACT_RATIO overrides it ("inf": auto is always static, whatever the table).
AUTO_COMPACT_RATIO = float(os.environ.get("DFLASH_JAX_AUTO_COMPACT_RATIO", 1.35))

# Prompts longer than this are prefilled in chunks of this many positions (prompt buckets above 1024 are
# multiples of 1024, so it always divides them): bounds prefill attention memory for long contexts.
PREFILL_CHUNK = 1024


def bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two (≥ minimum) below 1024, to a multiple of 1024 above."""
    if n <= 1024:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


def _tokenize(target: Target, prompts: Sequence[Prompt], chat: bool) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts (strings, token-id lists or chat message lists), "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    vocab = target.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or (isinstance(p, Sequence) and p and isinstance(p[0], dict)):
            if target.tokenizer is None:
                raise TokenizerMissingError(
                    f"prompt {i} is text but target {target.name!r} was loaded without tokenizer files; "
                    "pass token ids instead")
            if isinstance(p, str) and not p:
                raise ValueError(f"prompt {i} is empty")
            ids = target.tokenizer.encode(p, chat=chat)
        else:
            arr = np.asarray(p)
            if arr.size and arr.dtype.kind not in "iu":
                raise ValueError(f"prompt {i} must be text, a chat message list or token ids, got {p!r:.80}")
            ids = arr.astype(np.int64).reshape(-1)
            bad = ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5].tolist()}")
            ids = ids.tolist()
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.append(ids)
    return out


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def check_batch_size(batch_size) -> None:
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def _per_row(value, n: int, name: str, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full((n,), arr)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a number or one value per prompt ({n}), got shape {arr.shape}")
    return arr.astype(dtype)


def _setting(value, n: int, name: str, default: float, valid, expected: str) -> np.ndarray:
    """One sampling setting per row from a number, ``None`` (= ``default``, as HF and vLLM callers pass it)
    or one value per prompt; an error names the value that was given."""
    items = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(items) != n:
        raise ValueError(f"{name} must be a number or one value per prompt ({n} prompts), got {len(items)} "
                         f"values: {value!r}")
    out = np.empty(n, np.float64)
    for i, v in enumerate(items):
        v = default if v is None else v
        number = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        if not (number and np.isfinite(v) and valid(v)):
            raise ValueError(f"{name} must be {expected}, got {v!r}")
        out[i] = v
    return out


def sampling_params(n: int, temperature=None, top_k=None, top_p=None) -> SamplingParams:
    """Validated per-row sampling settings (HF meanings: temperature 0 = greedy, top_k 0 / top_p 1 = off;
    ``None`` = off), as host arrays: they reach the device once, padded to the batch's compiled shape."""
    t = _setting(temperature, n, "temperature", 0.0, lambda v: v >= 0, ">= 0 (0 or None = greedy)")
    k = _setting(top_k, n, "top_k", 0, lambda v: v >= 0 and v == int(v), "a non-negative integer (0 or None = off)")
    p = _setting(top_p, n, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1] (1 or None = off)")
    return SamplingParams(t.astype(np.float32), k.astype(np.int32), p.astype(np.float32))


# --------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------

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
    host: "_HostBatch | None" = None
    step_cost: np.ndarray | None = None  # the scheduler's cost per tier (scheduled verify modes)

    @property
    def survival_width(self) -> int:
        """G: drafts per cycle whose predicted survival is summed (DSpark confidence head; else 0)."""
        return self.programs.view_widths[2]


@functools.lru_cache(maxsize=256)
def _loop_spec(block_size: int, new_cap: int, capture: tuple, impl: str, sampled: bool, draft_sampling: bool,
               top_k: bool, top_p: bool, mesh, target_cfg, drafter_cfg, verify_mode: str = "static",
               tiers: tuple = (), ar_step: bool = False, tuning: Tuning = Tuning()) -> LoopSpec:
    from dflash_jax import sharding as shd

    return LoopSpec(block_size=block_size, new_capacity=new_cap, capture=capture, impl=impl,
                    prefill_chunk=PREFILL_CHUNK, sampling=sampled, draft_sampling=sampled and draft_sampling,
                    top_k=top_k, top_p=top_p, plan=shd.make_plan(mesh, target_cfg, drafter_cfg),
                    verify_mode=verify_mode, tiers=tiers, ar_step=ar_step, tuning=tuning)


@dataclasses.dataclass(frozen=True)
class _HostBatch:
    """A batch's host arrays, its rows padded to the compiled batch and its lengths bucketed."""

    prompt: np.ndarray  # [B, P] int32, right-padded with 0
    lens: np.ndarray  # [B] prompt lengths (dummy rows: 1)
    max_new: np.ndarray  # [B] (dummy rows: 1, discarded)
    stops: np.ndarray  # [bucketed] stop ids, -1 padding
    new_cap: int  # bucketed largest max_new_tokens
    capacity: int  # cache length: P + new_cap + L, a multiple of 16


def _checked_lengths(cfg, ids: list[list[int]], max_new_tokens) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, max new tokens per row), or ValueError where a row cannot fit the model."""
    n = len(ids)
    max_new = _per_row(max_new_tokens, n, "max_new_tokens", np.int64)
    for m in np.unique(max_new):
        check_max_new_tokens(int(m))
    lens = np.asarray([len(p) for p in ids])
    worst = lens + max_new
    if worst.max() > cfg.max_position_embeddings:
        i = int(np.argmax(worst))
        raise ValueError(f"prompt of {lens[i]} tokens + max_new_tokens {int(max_new[i])} exceeds the model's "
                         f"maximum length {cfg.max_position_embeddings}")
    return lens, max_new


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """What a run over more prompts than rows (:mod:`dflash_jax.continuous`) fixes for all its batches: the
    compiled decode program's buffers and sampling branches, from every prompt of the run."""

    new_cap: int  # bucketed largest max_new_tokens
    capacity: int  # cache length for the longest prompt
    sampling: SamplingParams  # every prompt's settings: decide which sampling steps are compiled


def _host_batch(ids: list[list[int]], lens: np.ndarray, max_new: np.ndarray, stops: tuple[int, ...], b: int,
                block_size: int, pool: PoolShape | None = None) -> _HostBatch:
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
    return _HostBatch(prompt, np.concatenate([lens, np.ones(pad, np.int64)]).astype(np.int32),
                      np.concatenate([max_new, np.ones(pad, np.int64)]).astype(np.int32), stop_arr, new_cap,
                      pool.capacity if pool else cache_length(p, new_cap, block_size))


def cache_length(prompt_bucket: int, new_cap: int, block_size: int) -> int:
    return -(-(prompt_bucket + new_cap + block_size) // 16) * 16


def prepare(target: Target, drafter: Drafter | None, ids: list[list[int]], *, max_new_tokens, block_size: int,
            stop_token_ids=None, attention_impl: str = "auto", temperature=None, top_k=None, top_p=None,
            seed: int = 0, draft_sampling: bool = False, pad_batch_to: int | None = None,
            verify_mode: str = "auto", cost_table=None, pool: PoolShape | None = None,
            return_at_done: int | None = None, decode: bool = True, tuning: Tuning = Tuning()) -> Job:
    """Validate and bucket one batch of token-id prompts. ``max_new_tokens``: one value or one per row.

    ``pad_batch_to`` adds finished dummy rows so that every batch of a run has the same compiled shape;
    ``pool`` and ``return_at_done``: the first batch of a continuous run (:mod:`dflash_jax.continuous`).
    ``decode=False`` compiles the prefill alone (``programs.decode`` is None: calibration times its own steps).
    Host work only, no per-parameter Python: the models' splits are cached on their handles and the
    programs are looked up by a small key.
    """
    from dflash_jax import sharding as shd

    cfg = target.config
    n = len(ids)
    lens, max_new = _checked_lengths(cfg, ids, max_new_tokens)
    sp = sampling_params(n, temperature, top_k, top_p)
    stops = target.stop_token_ids if stop_token_ids is None else tuple(int(s) for s in stop_token_ids)
    if drafter is not None and drafter.mesh is not target.mesh:
        raise shd.ShardingError("the target and the drafter must be placed on the same mesh (load the drafter "
                                "with the target: load_drafter(..., target=target) inherits its mesh)")
    dp = shd.mesh_size(target.mesh, "dp")
    b = -(-max(n, pad_batch_to or 0) // dp) * dp  # batch rows split evenly over dp
    host = _host_batch(ids, lens, max_new, stops, b, block_size, pool)
    flags = pool.sampling if pool else sp  # which sampling steps the programs compile
    sampled = bool((flags.temperature > 0).any())
    verify_mode, tiers, step_cost, ar_step = resolve_verify_mode(
        _check_verify_mode(verify_mode, drafter, block_size), drafter, b, block_size, cost_table, dp)
    if b > n:  # on the host: eager device ops would compile anew for each partial batch's row count
        sp = SamplingParams(*(np.concatenate([x, np.repeat(x[-1:], b - n)]) for x in
                              (sp.temperature, sp.top_k, sp.top_p)))

    spec = _loop_spec(block_size, host.new_cap, tuple(drafter.config.target_layer_ids) if drafter is not None else (),
                      resolve_impl(attention_impl, target.model.dtype), sampled, bool(draft_sampling),
                      sampled and bool((flags.top_k > 0).any()), sampled and bool((flags.top_p < 1).any()),
                      target.mesh, cfg, drafter.config.layers if drafter is not None else None, verify_mode, tiers,
                      ar_step, tuning)
    tsplit = target.split()
    dsplit = drafter.split() if drafter is not None else None
    mask_id = drafter.config.mask_token_id if drafter is not None else 0
    graphdefs = (tsplit.static, dsplit.static if dsplit else None)
    params = (tsplit.leaves, dsplit.leaves if dsplit else None)
    ints, floats = pack_inputs(host.prompt, host.lens, host.max_new, host.stops, seed, sp if sampled else None,
                               step_cost, return_at_done)
    # One host-to-device copy per vector (each costs ~0.25 ms on a GPU, whatever its size). On one device the
    # compiled program takes the numpy vectors itself (its C++ path skips device_put's Python: ~0.2 ms less
    # per call on the CPU, bench_transfer.py); under a mesh they are placed replicated first.
    pre_args = (params, *jax.device_put((ints, floats), spec.plan.replicated())) if spec.plan else (
        params, ints, floats)
    shapes = dict(batch=b, prompt_len=host.prompt.shape[1], num_stops=len(host.stops))
    key = (spec, host.capacity, mask_id, tuple(shapes.values()), tsplit.structure,
           dsplit.structure if dsplit else None, jax.config.jax_default_matmul_precision, decode, trace_switches())
    t0 = time.perf_counter()
    programs = _programs(key, graphdefs, params, pre_args, spec, dict(capacity=host.capacity, **shapes), mask_id,
                         decode)
    return Job(target, drafter, ids, stops, params, pre_args, spec, programs, time.perf_counter() - t0, key, host,
               step_cost)


def resolve_verify_mode(mode, drafter: Drafter | None, batch: int, block_size: int, cost_table=None,
                        dp: int = 1, tuning: Tuning | None = None
                        ) -> tuple[verify_modes.VerifyMode, tuple[int, ...], np.ndarray | None, bool]:
    """(verify mode, compiled tiers, step cost per tier [+ the AR step's], AR step offered) for a batch of
    ``batch`` rows, from the cost table: the mode's (or, for ``"auto"``, the policy's) own resolution
    (:meth:`dflash_jax.decode.verify_modes.VerifyPolicy.resolve`; docs/verify-modes.md). ``mode``: a name or a
    strategy. Under a ``dp`` mesh the costs are those of a device's ``batch / dp`` rows (what each device
    runs). ``tuning``: its ``auto_compact_ratio`` steers auto (default: :data:`AUTO_COMPACT_RATIO`). Host work
    only (nothing compiles)."""
    policy = verify_modes.by_name(mode)
    if tuning is None:
        tuning = Tuning(auto_compact_ratio=AUTO_COMPACT_RATIO)
    has_confidence = drafter is not None and drafters.kind_of(drafter.model).has_confidence
    batch_costs = verify_modes.BatchCosts(
        batch, block_size, dp, has_confidence,
        lambda: costs.resolve(cost_table, jax.default_backend(), drafter.cost_tables))
    return tuple(policy.resolve(batch_costs, tuning))


def _check_verify_mode(mode, drafter: Drafter | None, block_size: int) -> verify_modes.VerifyPolicy:
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
    return job.programs.decode(job.params, state, np.int32(max_cycles))[1]


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
    if job.survival_width:
        stats.update(survival_stats(view.survival_sum[:n], acc_lens))
    if job.spec.block_size > 1:
        stats.update(verify_stats(job.spec, view, n, acc_lens))
    return GenerationOutput(token_ids, texts, acc_lens, float(np.mean(all_acc)) if all_acc else 0.0, stats,
                            job.ids, finish_reasons(token_ids, job.stops))


def survival_stats(survival_sum: np.ndarray, acc_lens: list[list[int]]) -> dict:
    """A scoring drafter's calibration (:func:`dflash_jax.drafters.survival_stats`): ``predicted_survival[j]``
    the mean predicted probability that draft j is accepted next to ``realized_survival[j]`` the fraction of
    cycles that accepted it; ``predicted_tau`` vs the realised τ."""
    return drafters.survival_stats(survival_sum, acc_lens)


def verify_stats(spec: LoopSpec, view: DecodeView, n: int, acc_lens: list[list[int]]) -> dict:
    """What verifying cost, as the verify mode reports it (:meth:`dflash_jax.decode.verify_modes.VerifyMode.stats`):
    ``verify_mode``, ``verify_tokens`` (tokens through the target's verify, summed over rows and cycles),
    ``mean_window`` (the tokens per row and cycle the schedule verifies or — cap-accept — commits from, anchor
    included: L for static); for scheduled modes ``tier_steps`` (steps per compiled tier: {tokens: steps}),
    ``ar_steps`` (steps the scheduler ran without drafting, when offered) and ``row_verify_tokens`` (each row's
    windows, summed); for cap-accept ``utilization``: committed tokens ÷ what committing every accepted draft of
    the whole block would have given (1.0: trimming gave up nothing) and ``row_untrimmed`` (per row, that
    whole-block figure)."""
    return spec.verify_mode.stats(spec, view, n, acc_lens)


def _checked_ids(target: Target, prompts, *, chat: bool, **kw) -> list[list[int]]:
    """Validate every argument (before tokenizing), then tokenize."""
    n = len(prompts) if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) else 0
    sampling_params(max(n, 1), kw.get("temperature"), kw.get("top_k"), kw.get("top_p"))
    check_max_new_tokens(kw["max_new_tokens"])
    return _tokenize(target, prompts, chat)


def make_job(target: Target, drafter: Drafter | None, prompts, *, chat: bool, **kw) -> Job:
    """Validate every argument (before tokenizing), tokenize, prepare."""
    return prepare(target, drafter, _checked_ids(target, prompts, chat=chat, **kw), **kw)


def _run(target: Target, drafter: Drafter | None, prompts, *, chat: bool, batch_size: int | None = None,
         **kw) -> GenerationOutput:
    """Prepare, then run prefill and decode with a sync between them (for the timing stats); with more prompts
    than ``batch_size``, continuous batching (:mod:`dflash_jax.continuous`)."""
    if batch_size is not None:
        check_batch_size(batch_size)
        ids = _checked_ids(target, prompts, chat=chat, **kw)
        if len(ids) > batch_size:
            from dflash_jax import continuous

            return continuous.run(target, drafter, ids, batch_size=batch_size, **kw)
        job = prepare(target, drafter, ids, **kw)
    else:
        job = make_job(target, drafter, prompts, chat=chat, **kw)
    t1 = time.perf_counter()
    state, packed = job.programs.prefill(*job.pre_args)
    packed.block_until_ready()
    t2 = time.perf_counter()
    state, packed = job.programs.decode(job.params, state, ALL_CYCLES)
    view = fetch_view(job, packed)  # waits for the decode, then one device-to-host copy
    t3 = time.perf_counter()
    prefill_s, decode_s = t2 - t1, t3 - t2
    out = collect(job, view, {"prefill_s": prefill_s, "decode_s": decode_s, "compile_s": job.compile_s})
    total, b = out.stats["new_tokens"], len(job.ids)
    out.stats["tokens_per_s"] = total / max(prefill_s + decode_s, 1e-9)
    out.stats["decode_tokens_per_s"] = (total - b) / max(decode_s, 1e-9)
    return out


def speculative_settings(target, drafter, block_size: int | None) -> tuple[Target, Drafter, int]:
    """The handles and the checked block size: the tokens one cycle verifies (default: the drafter's trained
    verify width — a DFlash drafter's block size, a DSpark drafter's block size + 1)."""
    target, drafter = as_target(target), as_drafter(drafter)
    drafter.config.check_target(target.config)
    trained = drafter.config.verify_width
    size = trained if block_size is None else block_size
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 2 <= size <= trained:
        raise ValueError(f"block_size must be in [2, {trained}] for this drafter (an integer; trained block size "
                         f"{trained}), got {block_size!r}")
    return target, drafter, int(size)


def speculative_generate(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 256,
    *,
    block_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    chat_template: bool = True,
    attention_impl: str = "auto",
    temperature: float | Sequence[float] | None = 0.0,
    top_k: int | Sequence[int] | None = 0,
    top_p: float | Sequence[float] | None = 1.0,
    seed: int = 0,
    draft_sampling: bool = False,
    verify_mode: str = "auto",
    cost_table=None,
    batch_size: int | None = None,
    tuning: Tuning = Tuning(),
) -> GenerationOutput:
    """Lossless DFlash speculative decoding: greedy output identical to :func:`generate`, sampled output with
    exactly the target's distribution — with fewer target calls.

    ``prompts``: strings (tokenized with the target's chat template), chat message lists, or token-id lists.
    ``block_size`` (default: the drafter's trained size) may be any value in ``2 … trained size``.
    ``stop_token_ids`` defaults to the target's end-of-turn ids; pass ``[]`` to disable stopping.
    ``temperature`` / ``top_k`` / ``top_p``: HF meanings, a value for all prompts or one per prompt
    (temperature 0 = greedy; ``None`` = off). ``seed`` makes sampled runs reproducible. ``draft_sampling``:
    draw drafts from the drafter's own distribution (accept with min(1, p/q)) instead of taking its argmax.
    ``verify_mode`` (README "Verify modes"): ``"auto"`` (default) is compact where the cost table says trimming can
    pay at this batch size (it times static's step, or :data:`AUTO_COMPACT_RATIO`), static elsewhere; ``"static"``
    verifies the whole block every cycle; ``"compact"`` lets the confidence scheduler pick each row's window per
    cycle and verifies only those windows, packed; ``"cap-accept"`` verifies the whole block but commits only the
    windows (what compact commits), recording what trimming gave up (``stats["utilization"]``). ``cost_table``: the
    scheduler's step costs (a :class:`dflash_jax.costs.CostTable` or a ``.costs.json`` path; default: the pair's,
    from ``dflash-jax calibrate``, else the one shipped for this backend). ``batch_size``: decode at most this many
    prompts at once; a row that finishes takes the next prompt (continuous batching: README "Many prompts").
    :func:`dflash_jax.speculative_stream` takes the same arguments and yields the output as it is made.
    """
    target, drafter, block_size = speculative_settings(target, drafter, block_size)
    return _run(target, drafter, prompts, max_new_tokens=max_new_tokens, block_size=block_size,
                stop_token_ids=stop_token_ids, chat=chat_template, attention_impl=attention_impl,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, draft_sampling=draft_sampling,
                verify_mode=verify_mode, cost_table=cost_table, batch_size=batch_size, tuning=tuning)


def generate(
    target: Target,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 256,
    *,
    stop_token_ids: Sequence[int] | None = None,
    chat_template: bool = True,
    attention_impl: str = "auto",
    temperature: float | Sequence[float] | None = 0.0,
    top_k: int | Sequence[int] | None = 0,
    top_p: float | Sequence[float] | None = 1.0,
    seed: int = 0,
    batch_size: int | None = None,
) -> GenerationOutput:
    """Plain autoregressive decoding with the same target code (the speed and correctness baseline);
    greedy by default, sampling and ``batch_size`` as in :func:`speculative_generate`
    (:func:`dflash_jax.stream_generate` streams it)."""
    return _run(as_target(target), None, prompts, max_new_tokens=max_new_tokens, block_size=1,
                stop_token_ids=stop_token_ids, chat=chat_template, attention_impl=attention_impl,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size)
