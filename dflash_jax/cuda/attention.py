"""GPU attention kernels for the decode loop: Pallas lowered to Triton (NVIDIA GPUs, sm80+; tuned on Hopper).

All three operations read a large KV cache with a handful of queries per KV head, so they are memory-bound: the
goal is to read each live K/V row once and nothing past a row's length. Letters: B batch rows (requests),
L block / window length, T packed query rows, N query heads, K KV heads, G = N // K queries per KV head,
H head dim, S cache slots.

* :func:`draft_attention` — the drafter: the L block queries of row ``b`` attend to its context cache
  (slots ``< ctx_len[b]``, optionally a sliding window) and to the block's own L keys (non-causal, or causal
  + window), one joint softmax, exactly as :func:`dflash_jax.kernels.attention.draft_attention`.
* :func:`ragged_verify_attention` — the target's verify: request ``r`` owns the packed query rows
  ``cu_q_lens[r] : cu_q_lens[r+1]`` (ℓ_r ≤ ``max_q_len`` rows, possibly 0) and attends causally to cache row
  ``r`` up to ``kv_lens[r]``, as :func:`dflash_jax.kernels.attention.ragged_verify_attention`; optionally with
  gpt-oss's attention sinks (``sinks [N]``) and sliding window (``window``).
* :func:`packed_block_attention` — compact mode's packed verify windows whose own K/V are not in the cache
  (its tiers only read the cache): the ragged op's packed query rows with the draft op's "own keys as one more
  block" (causal), request ``r``'s window starting at position ``starts[r]`` and attending to its cache rows
  below it — read and written packed, so nothing is unpacked to ``[B, L]`` and back around the kernel.

Design (flash decoding):

* **Tile = all queries of one KV head.** A program owns (request, KV head, split): its G·L query rows are
  one ``[M, H]`` tile, ``M = Lp·Gp`` with ``Gp`` = G and ``Lp`` = L rounded up to powers of two and ``M >= 16``
  (``tl.dot`` needs 16 rows; padded rows load zeros and are never stored). So every K/V block is read once
  per KV head — GQA costs no extra bandwidth — and the two products per block are real matrix products
  ``[M,H]x[H,BK]`` and ``[M,BK]x[BK,H]`` on the tensor cores.
* **Online softmax over KV blocks of ``block_k`` rows** (default 64, 4 warps, 3 pipeline stages: a 64x128
  bf16 K block plus V block is 32 KiB, 3 stages + the Q tile take 112 KiB of shared memory, 2 programs per
  SM, and the ``[64, 64]`` f32 score tile stays in registers; in ``benchmarks/bench_attention.py --sweep`` 3
  stages beat 2, 4 warps beat 8, and block_k 32/64/128 were within noise of each other). Scores, running max /
  sum and the accumulator are float32; P is cast to V's dtype for the second product, like the reference. The
  loop's trip count is computed from the row's length: blocks at or past ``ctx_len`` / ``kv_len`` (and, with a
  sliding window, blocks wholly before it) are never read.
* **Garbage never leaks.** K/V rows past a length are loaded with a mask (``other=0``), so NaN/Inf padding
  never enters registers (a ``p·V`` with ``p = 0`` and ``V = NaN`` would still be NaN); masked scores are
  set to the reference's -1e30 and their probabilities are selected to 0.
* **Split-KV ("flash decoding").** With few (request, KV head) pairs — batch 1 has only K = 8 programs on a
  132-SM GPU — the cache is cut into ``num_splits`` chunks of ``chunk`` rows (a multiple of ``block_k``),
  one program each (grid ``(B, K, splits)``). Each split writes its normalised rows (f32) and their
  log-sum-exp straight into the output row layout of its slice of ``[NSp, T, N, H]`` / ``[NSp, T, N]``
  (splits with no live rows write zeros and -1e30: weight 0). A second, small Pallas kernel merges them:
  one program per few output rows loads *all* splits in one wide masked block ``[NSp, rows, H]`` (many
  bytes in flight, no loop), weights them by ``exp(lse - max lse)`` and writes the output (and the zeros
  of the ragged op's padding rows). Measured, one program streams only ~16 GB/s (the loop is
  bound by its per-block work, not by latency: more pipeline stages do not help), so the default aims at
  ~3 programs per SM — ``ceil(3·SMs / (B·K))`` splits, but chunks of at least ``min_chunk`` = 256 rows —
  which puts batch 1 at 16k-32k context at ~40-47 splits. ``num_splits=1`` skips the second pass: the
  program normalises and stores the output itself (grid row B of the ragged op writes the padding zeros).
* **Draft op:** the block's own K/V (at ``q_positions``) are one more "KV block" with their own mask,
  processed by the last live split after the context loop. ``q_positions`` may be anything (the mask is
  built from it, as in the reference); the decode loop passes ``ctx_len[b] + arange(L)``.
* **Ragged verify tiling:** each request's window is mapped into its own padded tile — a program reads
  ``cu_q_lens[r]`` / ``cu_q_lens[r+1]`` / ``kv_lens[r]`` as scalars and loads the ``Lp`` rows from
  ``cu_q_lens[r]`` with a row mask ``i < ℓ_r`` (rows of the next request are masked out, never written).
  This keeps one program per (request, KV head) as in the static-window case — a window is at most
  ``max_q_len`` rows (a static bound, the block size), so a request never spans two tiles and no
  cross-program reduction or search over ``cu_q_lens`` is needed; rows of a short window cost only padded
  tile rows, not extra cache reads. Query ``i`` sits at position ``kv_lens[r] - ℓ_r + i``; the causal
  mask ``j <= pos_i`` only bites in the last block(s). An extra program row (request index B) writes the
  zeros of the padding rows ``[cu_q_lens[B], T)``. A request with ℓ_r = 0 reads no cache at all.
* **Sinks and windows** (ragged verify, gpt-oss): a sink is one more key with logit ``sink[n]`` and value 0,
  so split 0's program starts its running max at the sink and its running sum at 1 (the other splits start
  empty, -1e30 and 0). The sink is thus counted exactly once: in the single pass directly, with splits
  through split 0's log-sum-exp (split 0 always writes a finite one, even when its chunk holds no visible
  key), and the merge kernel needs no change. A sliding window masks keys with ``pos - j >= window``, and
  the loop starts at the block holding the first query's first visible key (``kv_len - ℓ - window + 1``):
  blocks wholly before it are never read, as in the draft op.

Preconditions (not checked at run time, as in the references): ``0 <= ctx_len <= S``, ``kv_lens[r] <= S``,
``ℓ_r <= max_q_len`` and ``ℓ_r <= kv_lens[r]``, ``cu_q_lens`` non-decreasing with ``cu_q_lens[B] <= T``.
Use :func:`draft_attention_unsupported_reason` / :func:`ragged_verify_unsupported_reason` to find out
whether a call can run here (else fall back to the jnp reference).

Float32 inputs follow JAX's default matmul precision, as XLA's own float32 dots do: TF32 by default, IEEE
float32 (``Precision.HIGHEST``) under ``jax.default_matmul_precision("highest")`` / ``"float32"``. The IEEE
mode runs on the CUDA cores, not the tensor cores: about 10× slower in the decode loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.cuda.common import SUPPORTED_DTYPES, cdiv, highest_precision_requested, next_pow2, num_sms
from dflash_jax.kernels.common import HEAD_VECTOR, HEADS, mesh_sizes, native, rows, run_kernel, unsharded
from dflash_jax.tuning import Kernels

__all__ = [
    "cache_attention_kernel",
    "draft_attention_kernel",
    "packed_verify_kernel",
    "prefill_attention_kernel",
    "draft_attention",
    "ragged_verify_attention",
    "packed_block_attention",
    "draft_attention_unsupported_reason",
    "ragged_verify_unsupported_reason",
    "packed_block_unsupported_reason",
]

NEG_INF = -1e30  # the references' mask value
_MAX_TILE_ROWS = 256  # M = Lp·Gp: the f32 accumulator [M, H] must fit in registers
PROGRAMS_PER_SM = 3  # split-KV target (default): measured per-program throughput is ~16 GB/s, so concurrency matters
DEFAULT_MIN_CHUNK = 256  # fewest cache rows per split
# Fewest cache rows per split where the unsplit grid already fills every SM: there a split adds a pass and a
# merge kernel for little concurrency (one pass at 64 / 128 rows and caches of 400–656 rows made AR, static and
# compact steps up to 7 % faster than splitting).
FILLED_MIN_CHUNK = 1024


# --------------------------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Static kernel configuration (hashable: it parameterises the traced kernels)."""

    lp: int  # query positions per tile (power of two)
    gp: int  # query heads per KV head in the tile (G rounded up to a power of two)
    g: int  # G
    h: int  # H
    block_k: int  # cache rows per KV block
    chunk: int  # cache rows per split (multiple of block_k)
    num_splits: int
    num_warps: int
    num_stages: int
    scale: float
    ieee_f32: bool  # float32 inputs under "highest" default precision: IEEE float32 dots (else TF32)

    @property
    def m(self) -> int:
        return self.lp * self.gp


def _make_tiling(*, rows: int, n: int, k: int, h: int, s: int, programs: int, dtype, block_k: int | None,
                 num_splits: int | None, min_chunk: int, num_warps: int | None, num_stages: int | None,
                 programs_per_sm: int = 0) -> _Tiling:
    g = n // k
    gp = next_pow2(g)
    lp = next_pow2(max(rows, cdiv(16, gp)))
    m = lp * gp
    bk = block_k or 64
    bk = max(16, min(bk, next_pow2(s)))  # never a block (much) bigger than the cache
    if num_splits is None:
        # ~``programs_per_sm`` programs per SM (0: PROGRAMS_PER_SM), but chunks of at least min_chunk rows so the
        # partials stay cheap (and much longer ones where the programs fill the SMs unsplit).
        want = cdiv((programs_per_sm or PROGRAMS_PER_SM) * num_sms(), max(programs, 1))
        if programs >= num_sms():
            min_chunk = max(min_chunk, FILLED_MIN_CHUNK)
        num_splits = max(1, min(want, s // max(min_chunk, bk)))
    num_splits = max(1, min(num_splits, cdiv(s, bk)))
    chunk = cdiv(cdiv(s, num_splits), bk) * bk
    num_splits = cdiv(s, chunk)
    if num_warps is None:
        num_warps = 4 if m <= 64 else 8
    if num_stages is None:
        num_stages = 3
    return _Tiling(lp=lp, gp=gp, g=g, h=h, block_k=bk, chunk=chunk, num_splits=num_splits, num_warps=num_warps,
                   num_stages=num_stages, scale=h ** -0.5,
                   ieee_f32=jnp.dtype(dtype) == jnp.float32 and highest_precision_requested())


def _compiler_params(t: _Tiling):
    return plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


# ------------------------------------------------------------------------------------ kernel pieces


def _dot(a: jax.Array, b: jax.Array, t: _Tiling, *, trans_b: bool) -> jax.Array:
    """a @ b (or a @ b.T) with float32 accumulation; float32 inputs: IEEE or TF32 (see the module notes)."""
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    prec = lax.Precision.HIGHEST if t.ieee_f32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _row_masks(t: _Tiling, q_len) -> jax.Array:
    """[Lp, Gp, 1] mask of the tile's real rows (query index < q_len, head < G)."""
    return ((jnp.arange(t.lp) < q_len)[:, None, None]) & ((jnp.arange(t.gp) < t.g)[None, :, None])


def _load_q(q_ref, t: _Tiling, q0, q_len, kh) -> jax.Array:
    """Query rows q0 .. q0+Lp of heads kh·G .. kh·G+Gp as one [M, H] tile (row = l·Gp + g); padding = 0."""
    q = plgpu.load(q_ref.at[pl.ds(q0, t.lp), pl.ds(kh * t.g, t.gp), :], mask=_row_masks(t, q_len), other=0.0)
    return q.reshape(t.m, t.h)


def _rows(t: _Tiling, per_query: jax.Array) -> jax.Array:
    """[Lp] per-query values → [M] per-tile-row values."""
    return jnp.broadcast_to(per_query[:, None], (t.lp, t.gp)).reshape(t.m)


def _init_carry(t: _Tiling):
    return (jnp.zeros((t.m, t.h), jnp.float32), jnp.full((t.m,), NEG_INF, jnp.float32),
            jnp.zeros((t.m,), jnp.float32))


def _load_sinks(sink_ref, t: _Tiling, kh) -> jax.Array:
    """The sink logits of heads kh·G .. kh·G+Gp as per-tile-row values [M] (row = l·Gp + g); padding = 0."""
    sink = plgpu.load(sink_ref.at[pl.ds(kh * t.g, t.gp)], mask=jnp.arange(t.gp) < t.g, other=0.0)
    return jnp.broadcast_to(sink.astype(jnp.float32)[None, :], (t.lp, t.gp)).reshape(t.m)


def _online_update(carry, s: jax.Array, mask: jax.Array, v: jax.Array, t: _Tiling):
    """One flash step: scores s [M, BK] (already scaled), visibility mask, values v [BK, H]."""
    acc, m_prev, l_prev = carry
    s = jnp.where(mask, s, NEG_INF)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # select, not multiply: no 0·garbage
    l_next = alpha * l_prev + p.sum(axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, t, trans_b=False)
    return acc, m_next, l_next


def _context_loop(carry, q, k_ref, v_ref, b, kh, split, lo, hi, row_pos, t: _Tiling, *, causal: bool,
                  window: int | None):
    """Attend to cache rows [lo, hi) of (b, kh) that fall in split ``split``."""
    c_lo = jnp.maximum(lo, split * t.chunk)
    c_hi = jnp.minimum(hi, split * t.chunk + t.chunk)
    blk_lo = lax.div(c_lo, t.block_k)
    blk_hi = jnp.maximum(lax.div(c_hi + t.block_k - 1, t.block_k), blk_lo)  # chunk % block_k == 0: disjoint

    def body(j, carry):
        start = pl.multiple_of(j * t.block_k, t.block_k)
        cols = start + jnp.arange(t.block_k)
        live = cols < hi  # rows past the length are garbage: never loaded
        k = plgpu.load(k_ref.at[b, pl.ds(start, t.block_k), kh, :], mask=live[:, None], other=0.0)
        v = plgpu.load(v_ref.at[b, pl.ds(start, t.block_k), kh, :], mask=live[:, None], other=0.0)
        s = _dot(q, k, t, trans_b=True) * t.scale
        mask = live[None, :]
        if causal:
            mask = mask & (cols[None, :] <= row_pos[:, None])
        if window is not None:
            mask = mask & (row_pos[:, None] - cols[None, :] < window)
        return _online_update(carry, s, mask, v, t)

    return lax.fori_loop(blk_lo, blk_hi, body, carry)


def _store_rows(o_ref, out: jax.Array, t: _Tiling, q0, q_len, kh, lead: tuple = ()) -> None:
    """Write the [M, H] tile back to rows q0 .. q0+q_len, heads kh·G .. kh·G+G of o_ref [*lead, T, N, H]
    (one indexer: the Triton lowering does not compose ``.at`` views)."""
    out = out.reshape(t.lp, t.gp, t.h).astype(o_ref.dtype)
    plgpu.store(o_ref.at[(*lead, pl.ds(q0, t.lp), pl.ds(kh * t.g, t.gp), slice(None))], out,
                mask=_row_masks(t, q_len))


def _finish(carry, out_refs, t: _Tiling, split, q0, q_len, kh) -> None:
    """Single pass: normalise and store. Split pass: store this split's normalised rows and their
    log-sum-exp into its slice of the partials (empty splits store 0 and -1e30: weight 0 in the merge)."""
    acc, m, l = carry
    if t.num_splits == 1:
        (o_ref,) = out_refs
        _store_rows(o_ref, acc / l[:, None], t, q0, q_len, kh)
    else:
        o_ref, lse_ref = out_refs
        live = l > 0
        _store_rows(o_ref, jnp.where(live[:, None], acc / l[:, None], 0.0), t, q0, q_len, kh, lead=(split,))
        lse = jnp.where(live, m + jnp.log(jnp.where(live, l, 1.0)), NEG_INF).reshape(t.lp, t.gp)
        plgpu.store(lse_ref.at[split, pl.ds(q0, t.lp), pl.ds(kh * t.g, t.gp)], lse,
                    mask=_row_masks(t, q_len)[:, :, 0])


def _live_splits(t: _Tiling, hi) -> jax.Array:
    """Number of splits that hold cache rows < hi (at least 1); the last of them also takes the block keys."""
    return jnp.maximum(lax.div(hi + t.chunk - 1, t.chunk), 1)


def _merge_kernel(o_ref, lse_ref, *refs, num_splits: int, rows: int, total: int, n: int, num_req: int | None):
    """Split-KV second pass over ``rows`` rows of the [T·N, H] output: all splits are loaded at once (one
    wide load, many bytes in flight) and merged by their log-sum-exp. Ragged op: rows of tokens
    >= cu_q_lens[B] get zeros (their partials were never written)."""
    # o_ref [NSp, T·N, H] f32, lse_ref [NSp, T·N] f32 (splits >= num_splits never written), [cu_ref [B+1]].
    *cu, out_ref = refs
    r0 = pl.program_id(0) * rows
    row = r0 + jnp.arange(rows)
    nsp = o_ref.shape[0]
    live = (jnp.arange(nsp) < num_splits)[:, None] & (row < total)[None, :]
    lse = plgpu.load(lse_ref.at[:, pl.ds(r0, rows)], mask=live, other=NEG_INF)
    o = plgpu.load(o_ref.at[:, pl.ds(r0, rows), :], mask=live[:, :, None], other=0.0)
    w = jnp.exp(lse - lse.max(axis=0)[None, :])
    out = (o * w[:, :, None]).sum(axis=0) / w.sum(axis=0)[:, None]
    if num_req is not None:
        out = jnp.where((row < cu[0][num_req] * n)[:, None], out, 0.0)
    plgpu.store(out_ref.at[pl.ds(r0, rows), :], out.astype(out_ref.dtype), mask=(row < total)[:, None])


def _merge_splits(o_part: jax.Array, lse_part: jax.Array, t: _Tiling, dtype, cu: jax.Array | None,
                  interpret: bool) -> jax.Array:
    """o_part [NSp, T, N, H], lse_part [NSp, T, N] → [T, N, H] (ragged op: zeros past cu[B])."""
    nsp, t_rows, n, h = o_part.shape
    rows = max(1, min(64, 8192 // (nsp * h)))  # ≤ 8192 f32 values per program: 64 registers a thread
    total = t_rows * n
    kernel = functools.partial(_merge_kernel, num_splits=t.num_splits, rows=rows, total=total, n=n,
                               num_req=None if cu is None else cu.shape[0] - 1)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((total, h), dtype), grid=(cdiv(total, rows),),
                         interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                         name="dflash_merge_splits")(
        o_part.reshape(nsp, total, h), lse_part.reshape(nsp, total), *([] if cu is None else [cu]))
    return out.reshape(t_rows, n, h)


def _zero_rows(o_ref, t: _Tiling, start, end, kh) -> None:
    """Zeros in rows [start, end) of heads kh·G .. kh·G+G (the padding rows of the ragged op)."""
    zeros = jnp.zeros((t.lp, t.gp, t.h), o_ref.dtype)

    def body(i, carry):
        r0 = start + i * t.lp
        plgpu.store(o_ref.at[pl.ds(r0, t.lp), pl.ds(kh * t.g, t.gp), :], zeros, mask=_row_masks(t, end - r0))
        return carry

    lax.fori_loop(0, lax.div(end - start + t.lp - 1, t.lp), body, None)  # no carry: Triton cannot yield literals


# ---------------------------------------------------------------------------------- pass-1 kernels


def _draft_kernel(q_ref, ck_ref, cv_ref, bk_ref, bv_ref, qpos_ref, clen_ref, *out_refs, t: _Tiling, L: int,
                  s_len: int, causal: bool, window: int | None):
    # q_ref [B·L, N, H], ck/cv [B, S, K, H], bk/bv [B·L, K, H], qpos [B·L], clen [B].
    b, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q0 = b * L
    q = _load_q(q_ref, t, q0, L, kh)
    l_live = jnp.arange(t.lp) < L
    qpos = plgpu.load(qpos_ref.at[pl.ds(q0, t.lp)], mask=l_live, other=0)
    row_pos = _rows(t, qpos)
    hi = jnp.clip(clen_ref[b], 0, s_len)
    lo = jnp.int32(0)
    if window is not None:  # blocks wholly before every query's window are skipped
        lo = jnp.maximum(jnp.min(jnp.where(l_live, qpos, jnp.iinfo(jnp.int32).max)) - window + 1, 0)
    carry = _context_loop(_init_carry(t), q, ck_ref, cv_ref, b, kh, split, lo, hi, row_pos, t, causal=False,
                          window=window)
    lb = next_pow2(max(L, 16))
    b_live = jnp.arange(lb) < L
    kpos = plgpu.load(qpos_ref.at[pl.ds(q0, lb)], mask=b_live, other=0)
    carry = _own_keys(carry, q, lambda rows: bk_ref.at[rows, kh, :], lambda rows: bv_ref.at[rows, kh, :], q0,
                      b_live, kpos, row_pos, split == _live_splits(t, hi) - 1, t, causal=causal, window=window)
    _finish(carry, out_refs, t, split, q0, L, kh)


def _own_keys(carry, q, k_rows, v_rows, k0, live, kpos, row_pos, owner, t: _Tiling, *, causal: bool,
              window: int | None):
    """The queries' own K/V (rows k0 … k0+len(live), ``live`` of them, at positions ``kpos``; ``k_rows(rows)``
    / ``v_rows(rows)``: the ref view of those rows of this program's KV head) as one more KV block, attended by
    the split ``owner`` only (the last live one: the cache's rows come first)."""
    rows = pl.ds(k0, live.shape[0])
    kb = plgpu.load(k_rows(rows), mask=live[:, None], other=0.0)
    vb = plgpu.load(v_rows(rows), mask=live[:, None], other=0.0)
    s = _dot(q, kb, t, trans_b=True) * t.scale
    mask = live[None, :] & owner
    if causal:
        mask = mask & (kpos[None, :] <= row_pos[:, None])
    if window is not None:
        mask = mask & (row_pos[:, None] - kpos[None, :] < window)
        if not causal:
            mask = mask & (kpos[None, :] - row_pos[:, None] < window)
    return _online_update(carry, s, mask, vb, t)


def _request_rows(cu_ref, r, t: _Tiling):
    """(first packed row, number of rows ≤ Lp) of request ``r``'s window."""
    q0 = cu_ref[r]
    return q0, jnp.clip(cu_ref[r + 1] - q0, 0, t.lp)


def _padding_program(out_refs, cu_ref, r, kh, t: _Tiling, num_req: int, total: int) -> None:
    """Grid row ``num_req`` writes the zeros of the padding rows [cu[B], total) — in the single pass only (the
    split merge writes them otherwise)."""
    if t.num_splits == 1:

        @pl.when(r == num_req)
        def _pad():
            _zero_rows(out_refs[0], t, cu_ref[num_req], total, kh)


def _packed_block_kernel(qkv_ref, ck_ref, cv_ref, cu_ref, start_ref, *out_refs, t: _Tiling, short: _Tiling | None,
                         num_req: int, s_len: int, window: int | None, n_heads: int):
    # qkv_ref [T, N + 2K, H] (queries, keys, values as heads): the windows packed end to end (request r's rows
    # cu[r] … cu[r+1]); ck/cv [B, S, K, H] read below start[r] (the window's first position) only. Grid (B+1,
    # K, splits): request B writes the padding rows' zeros. Program ids outside the pl.when bodies (interpret).
    # ``short``: windows of at most short.lp tokens run a second body with that smaller tile.
    r, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def attend(tt: _Tiling):
        q0, q_len = _request_rows(cu_ref, r, t)
        start = jnp.clip(start_ref[r], 0, s_len)
        hi = jnp.where(q_len > 0, start, 0)  # an empty window reads nothing
        lo = jnp.int32(0) if window is None else jnp.maximum(start - window + 1, 0)
        q = _load_q(qkv_ref, tt, q0, q_len, kh)  # heads kh·G … : the queries come first
        qpos = start + jnp.arange(tt.lp)
        row_pos = _rows(tt, qpos)
        carry = _context_loop(_init_carry(tt), q, ck_ref, cv_ref, r, kh, split, lo, hi, row_pos, tt, causal=False,
                              window=window)
        lb = next_pow2(max(tt.lp, 16))
        kpos = start + jnp.arange(lb)
        key, value = n_heads + kh, n_heads + n_heads // t.g + kh  # this KV head's key and value heads
        carry = _own_keys(carry, q, lambda rows: qkv_ref.at[rows, key, :], lambda rows: qkv_ref.at[rows, value, :],
                          q0, jnp.arange(lb) < q_len, kpos, row_pos, split == _live_splits(t, hi) - 1, tt,
                          causal=True, window=window)
        _finish(carry, out_refs, tt, split, q0, q_len, kh)

    if short is None:
        pl.when(r < num_req)(lambda: attend(t))
    else:
        real = jnp.minimum(r, num_req - 1)  # the padding program reads a real row's length, unused
        fits = cu_ref[real + 1] - cu_ref[real] <= short.lp
        pl.when((r < num_req) & fits)(lambda: attend(short))
        pl.when((r < num_req) & ~fits)(lambda: attend(t))

    _padding_program(out_refs, cu_ref, r, kh, t, num_req, qkv_ref.shape[0])


def _verify_kernel(q_ref, kc_ref, vc_ref, cu_ref, kvl_ref, *refs, t: _Tiling, num_req: int, s_len: int,
                   window: int | None, has_sinks: bool):
    # q_ref [T, N, H], kc/vc [B, S, K, H], cu [B+1], kvl [B], [sinks [N] f32]. Grid (B+1, K, splits); request
    # B = padding rows. Program ids are read outside the pl.when bodies (interpret mode cannot lower them
    # inside a cond).
    sink_ref, out_refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    r, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(r < num_req)
    def _attend():
        q0, q_len = _request_rows(cu_ref, r, t)
        kv_len = jnp.clip(kvl_ref[r], 0, s_len)
        hi = jnp.where(q_len > 0, kv_len, 0)  # an empty window reads nothing
        lo = jnp.int32(0)
        if window is not None:  # blocks wholly before the first query's window are skipped
            lo = jnp.where(q_len > 0, jnp.maximum(kv_len - q_len - window + 1, 0), 0)
        q = _load_q(q_ref, t, q0, q_len, kh)
        row_pos = _rows(t, kv_len - q_len + jnp.arange(t.lp))
        carry = _init_carry(t)
        if has_sinks:
            # The sink is one more key (logit = sink, value 0) in split 0 only: running max = sink, sum = 1. The
            # log-sum-exp merge then counts it exactly once (module docstring).
            acc, m, l = carry
            first = split == 0
            carry = (acc, jnp.where(first, _load_sinks(sink_ref, t, kh), m), jnp.where(first, 1.0, l))
        carry = _context_loop(carry, q, kc_ref, vc_ref, r, kh, split, lo, hi, row_pos, t, causal=True,
                              window=window)
        _finish(carry, out_refs, t, split, q0, q_len, kh)

    _padding_program(out_refs, cu_ref, r, kh, t, num_req, q_ref.shape[0])


def _partials_shape(t: _Tiling, t_rows: int, n: int, h: int):
    nsp = next_pow2(t.num_splits)  # padded to a power of two so the merge loads all splits in one block
    return [jax.ShapeDtypeStruct((nsp, t_rows, n, h), jnp.float32), jax.ShapeDtypeStruct((nsp, t_rows, n), jnp.float32)]


# ------------------------------------------------------------------------------------- public API


def _common_reason(q_dtype, kv_dtypes, n: int, k: int, h: int, interpret: bool) -> str | None:
    if not interpret and jax.default_backend() != "gpu":
        return f"needs a GPU backend (have {jax.default_backend()!r}; interpret=True runs on any backend)"
    if jnp.dtype(q_dtype) not in SUPPORTED_DTYPES:
        return f"dtype {jnp.dtype(q_dtype)} is not one of bfloat16/float16/float32"
    if any(jnp.dtype(d) != jnp.dtype(q_dtype) for d in kv_dtypes):
        return "q and K/V dtypes differ"
    if k < 1 or n % k:
        return f"N={n} is not a multiple of K={k}"
    if h < 16 or h > 256 or h & (h - 1):
        return f"head_dim {h} is not a power of two in [16, 256]"
    return None


def draft_attention_unsupported_reason(
    q, ctx_k, ctx_v, blk_k, blk_v, q_positions=None, ctx_len=None, *, causal: bool = False,
    window: int | None = None, interpret: bool = False, **_: object,
) -> str | None:
    """Why :func:`draft_attention` cannot run these shapes here (None when it can). Arrays or ShapeDtypeStructs."""
    del causal
    if q.ndim != 4 or ctx_k.ndim != 4:
        return "expected q [B, L, N, H] and ctx_k [B, S, K, H]"
    b, l, n, h = q.shape
    _, s, k, hk = ctx_k.shape
    if ctx_v.shape != ctx_k.shape or blk_k.shape != (b, l, k, h) or blk_v.shape != blk_k.shape or hk != h:
        return "K/V shapes do not match q"
    if ctx_k.shape[0] != b or s < 1 or l < 1:
        return "empty or mismatched batch / cache / block"
    if window is not None and window < 1:
        return f"window {window} < 1"
    reason = _common_reason(q.dtype, (ctx_k.dtype, ctx_v.dtype, blk_k.dtype, blk_v.dtype), n, k, h, interpret)
    if reason:
        return reason
    m = next_pow2(max(l, cdiv(16, next_pow2(n // k)))) * next_pow2(n // k)
    if m > _MAX_TILE_ROWS:
        return f"tile of {m} query rows (L={l} x G={n // k}, padded) exceeds {_MAX_TILE_ROWS}"
    return None


def ragged_verify_unsupported_reason(
    q, k_cache, v_cache, cu_q_lens=None, kv_lens=None, sinks=None, *, max_q_len: int | None = None,
    window: int | None = None, interpret: bool = False, **_: object,
) -> str | None:
    """Why :func:`ragged_verify_attention` cannot run these shapes here (None when it can)."""
    if q.ndim != 3 or k_cache.ndim != 4:
        return "expected q [T, N, H] and k_cache [B, S, K, H]"
    t_rows, n, h = q.shape
    b, s, k, hk = k_cache.shape
    if v_cache.shape != k_cache.shape or hk != h:
        return "K/V shapes do not match q"
    if b < 1 or s < 1 or t_rows < 1:
        return "empty batch / cache / queries"
    if window is not None and window < 1:
        return f"window {window} < 1"
    if sinks is not None and tuple(sinks.shape) != (n,):
        return f"sinks shape {tuple(sinks.shape)} is not (N,) = ({n},)"
    reason = _common_reason(q.dtype, (k_cache.dtype, v_cache.dtype), n, k, h, interpret)
    if reason:
        return reason
    lmax = t_rows if max_q_len is None else max_q_len
    if lmax < 1:
        return f"max_q_len {lmax} < 1"
    m = next_pow2(max(lmax, cdiv(16, next_pow2(n // k)))) * next_pow2(n // k)
    if m > _MAX_TILE_ROWS:
        return (f"tile of {m} query rows (max_q_len={lmax} x G={n // k}, padded) exceeds {_MAX_TILE_ROWS}"
                + ("; pass max_q_len (the block size)" if max_q_len is None else ""))
    return None


@functools.partial(jax.jit, static_argnames=("causal", "window", "block_k", "num_splits", "min_chunk", "num_warps",
                                             "num_stages", "interpret", "programs_per_sm"))
def draft_attention(
    q: jax.Array,  # [B, L, N, H]
    ctx_k: jax.Array,  # [B, S, K, H]
    ctx_v: jax.Array,  # [B, S, K, H]
    blk_k: jax.Array,  # [B, L, K, H]
    blk_v: jax.Array,  # [B, L, K, H]
    q_positions: jax.Array,  # [B, L] int32
    ctx_len: jax.Array,  # [B] int32
    *,
    causal: bool = False,
    window: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    programs_per_sm: int = 0,
) -> jax.Array:  # [B, L, N, H]
    """Drafter attention (see the module docstring); same semantics as ``dflash_jax.kernels.attention.draft_attention``.

    Tuning (static): ``block_k`` cache rows per KV block (default 64); ``num_splits`` KV splits (default: ~``programs_per_sm``
    programs per SM — 0: :data:`PROGRAMS_PER_SM` —, chunks ≥ ``min_chunk`` rows; 1 = single pass); ``num_warps`` (4 for tiles of ≤ 64 rows,
    else 8); ``num_stages`` software-pipeline depth (3).
    """
    b, l, n, h = q.shape
    _, s, k, _ = ctx_k.shape
    t = _make_tiling(rows=l, n=n, k=k, h=h, s=s, programs=b * k, dtype=q.dtype, block_k=block_k,
                     num_splits=num_splits, min_chunk=min_chunk, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm)
    q2 = q.reshape(b * l, n, h)  # free reshapes: a request's rows are contiguous, as in the ragged layout
    bk2, bv2 = blk_k.reshape(b * l, k, h), blk_v.reshape(b * l, k, h)
    qpos = q_positions.reshape(b * l).astype(jnp.int32)
    clen = ctx_len.astype(jnp.int32)
    single = t.num_splits == 1
    out_shape = jax.ShapeDtypeStruct((b * l, n, h), q.dtype) if single else _partials_shape(t, b * l, n, h)
    kernel = functools.partial(_draft_kernel, t=t, L=l, s_len=s, causal=causal, window=window)
    res = pl.pallas_call(kernel, out_shape=out_shape, grid=(b, k, t.num_splits), interpret=interpret,
                         compiler_params=_compiler_params(t), name="dflash_draft_attention")(
        q2, ctx_k, ctx_v, bk2, bv2, qpos, clen)
    if not single:
        res = _merge_splits(*res, t, q.dtype, None, interpret)
    return res.reshape(b, l, n, h)


def packed_block_unsupported_reason(qkv, k_cache, v_cache, *, max_q_len: int, window: int | None = None,
                                    interpret: bool = False, **_: object) -> str | None:
    """Why :func:`packed_block_attention` cannot run these shapes here (None when it can)."""
    if qkv.ndim != 3 or k_cache.ndim != 4:
        return "expected qkv [T, N + 2K, H] and k_cache [B, S, K, H]"
    n = qkv.shape[1] - 2 * k_cache.shape[2]
    if n < 1 or n % k_cache.shape[2]:
        return f"qkv's {qkv.shape[1]} heads are not N query heads + 2 × the cache's {k_cache.shape[2]} KV heads"
    q = jax.ShapeDtypeStruct((qkv.shape[0], n, qkv.shape[2]), qkv.dtype)
    return ragged_verify_unsupported_reason(q, k_cache, v_cache, max_q_len=max_q_len, window=window,
                                            interpret=interpret)


@functools.partial(jax.jit, static_argnames=("max_q_len", "short_q_len", "window", "block_k", "num_splits",
                                             "min_chunk", "num_warps", "num_stages", "interpret", "programs_per_sm"))
def packed_block_attention(
    qkv: jax.Array,  # [T, N + 2K, H]: queries, keys, values
    k_cache: jax.Array,  # [B, S, K, H]
    v_cache: jax.Array,  # [B, S, K, H]
    cu_q_lens: jax.Array,  # [B+1] int32
    starts: jax.Array,  # [B] int32
    *,
    max_q_len: int,
    short_q_len: int | None = None,
    window: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    programs_per_sm: int = 0,
) -> jax.Array:  # [T, N, H]
    """Packed verify windows whose own K/V are not in the cache (compact mode's tiers, which only read the
    cache): request ``r``'s rows ``cu_q_lens[r] : cu_q_lens[r+1]`` (at most ``max_q_len``) sit at positions
    ``starts[r] + i`` and attend to its cache rows ``< starts[r]`` and causally to their own keys and values —
    :func:`draft_attention`'s causal case read and written in the packed layout, so no unpacking to ``[B, L]``
    and back. Each row's queries, keys and values come as the heads of one operand (rotary embedding applied):
    one fusion of the projection's output writes it, where separate operands took a kernel each. Padding rows
    past ``cu_q_lens[B]`` get zeros. Same semantics as ``dflash_jax.kernels.packed.packed_verify_attention``
    without sinks. ``short_q_len``: windows of at most that many tokens (rounded up to fill a 16-row tile) run
    a second body of the kernel with a tile of that many query positions instead of ``max_q_len``'s (the
    compact tiers' windows are mostly 1–4 tokens, whose ``max_q_len`` tile is mostly padding rows). Tuning
    arguments as :func:`draft_attention`."""
    t_rows, heads, h = qkv.shape
    b, s, k, _ = k_cache.shape
    n = heads - 2 * k
    t = _make_tiling(rows=max_q_len, n=n, k=k, h=h, s=s, programs=b * k, dtype=qkv.dtype, block_k=block_k,
                     num_splits=num_splits, min_chunk=min_chunk, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm)
    cu = cu_q_lens.astype(jnp.int32)
    single = t.num_splits == 1
    out_shape = jax.ShapeDtypeStruct((t_rows, n, h), qkv.dtype) if single else _partials_shape(t, t_rows, n, h)
    short = None
    if short_q_len is not None:
        lp = next_pow2(max(short_q_len, cdiv(16, t.gp)))
        short = dataclasses.replace(t, lp=lp) if lp < t.lp else None
    kernel = functools.partial(_packed_block_kernel, t=t, short=short, num_req=b, s_len=s, window=window,
                               n_heads=n)
    res = pl.pallas_call(kernel, out_shape=out_shape, grid=(b + 1 if single else b, k, t.num_splits),
                         interpret=interpret, compiler_params=_compiler_params(t),
                         name="dflash_packed_block_attention")(qkv, k_cache, v_cache, cu, starts.astype(jnp.int32))
    if not single:
        res = _merge_splits(*res, t, qkv.dtype, cu, interpret)
    return res


@functools.partial(jax.jit, static_argnames=("max_q_len", "window", "block_k", "num_splits", "min_chunk",
                                             "num_warps", "num_stages", "interpret", "programs_per_sm"))
def ragged_verify_attention(
    q: jax.Array,  # [T, N, H]
    k_cache: jax.Array,  # [B, S, K, H]
    v_cache: jax.Array,  # [B, S, K, H]
    cu_q_lens: jax.Array,  # [B+1] int32
    kv_lens: jax.Array,  # [B] int32
    sinks: jax.Array | None = None,  # [N]
    *,
    max_q_len: int | None = None,
    window: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    min_chunk: int = DEFAULT_MIN_CHUNK,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    programs_per_sm: int = 0,
) -> jax.Array:  # [T, N, H]
    """Packed verify windows (see the module docstring); same semantics as
    ``dflash_jax.kernels.attention.ragged_verify_attention`` for windows of at most ``max_q_len`` rows.

    ``max_q_len`` (static) bounds every window ℓ_r; None means T (always correct, but the tile then has
    T·G rows: pass the block size). ``sinks``: a logit per query head that joins every softmax denominator
    and carries no value (gpt-oss). ``window`` (static): a query at position p sees keys ``p - window < j <=
    p``. Tuning arguments as :func:`draft_attention`.
    """
    t_rows, n, h = q.shape
    b, s, k, _ = k_cache.shape
    lmax = t_rows if max_q_len is None else max_q_len
    t = _make_tiling(rows=lmax, n=n, k=k, h=h, s=s, programs=b * k, dtype=q.dtype, block_k=block_k,
                     num_splits=num_splits, min_chunk=min_chunk, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm)
    cu = cu_q_lens.astype(jnp.int32)
    kvl = kv_lens.astype(jnp.int32)
    single = t.num_splits == 1
    out_shape = jax.ShapeDtypeStruct((t_rows, n, h), q.dtype) if single else _partials_shape(t, t_rows, n, h)
    # Grid row B (zeros for the padding rows) only exists when this pass writes the output.
    grid = (b + 1 if single else b, k, t.num_splits)
    kernel = functools.partial(_verify_kernel, t=t, num_req=b, s_len=s, window=window,
                               has_sinks=sinks is not None)
    extra = [] if sinks is None else [sinks.astype(jnp.float32)]
    res = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret,
                         compiler_params=_compiler_params(t), name="dflash_ragged_verify_attention")(
        q, k_cache, v_cache, cu, kvl, *extra)
    if not single:
        res = _merge_splits(*res, t, q.dtype, cu, interpret)
    return res


# ------------------------------------------------------------------- entries of the kernel dispatch
# (dflash_jax.kernels.dispatch: each takes its op's arguments and returns None where the reference must run)


def cache_attention_kernel(q, k_cache, v_cache, q_positions, *, sinks=None, window=None, kernels: Kernels):
    """``cache_attention`` of consecutive windows as the ragged verify kernel (ℓ_r = T for every row)."""
    interpret = not native("cuda")
    programs = kernels.tuning.programs_per_sm

    def local(q, k_cache, v_cache, q_positions, sinks=None):
        b, t, n, h = q.shape
        cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * t)  # a constant: no kernel per layer each step
        kv_lens = (q_positions[:, -1] + 1).astype(jnp.int32)
        out = ragged_verify_attention(q.reshape(b * t, n, h), k_cache, v_cache, cu, kv_lens, sinks, max_q_len=t,
                                      window=window, interpret=interpret, programs_per_sm=programs)
        return out.reshape(q.shape)

    def reason(q, k_cache, v_cache, q_positions, sinks=None):
        b, t, n, h = q.shape
        return ragged_verify_unsupported_reason(jax.ShapeDtypeStruct((b * t, n, h), q.dtype), k_cache, k_cache,
                                                sinks=sinks, max_q_len=t, window=window, interpret=interpret)

    heads = () if sinks is None else (sinks,)
    return run_kernel("cuda", "verify attention", (window,), local, reason, (q, k_cache, v_cache, q_positions, *heads),
                      (HEADS, HEADS, HEADS, rows(2)) + (HEAD_VECTOR,) * len(heads))


def draft_attention_kernel(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len, *, causal: bool, window,
                           kernels: Kernels, once: bool = False):
    """``draft_attention`` (no sinks) as :func:`draft_attention`."""
    interpret = not native("cuda")

    def local(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len):
        return draft_attention(q, ctx_k, ctx_v, blk_k, blk_v, q_positions.astype(jnp.int32),
                               ctx_len.astype(jnp.int32), causal=causal, window=window, interpret=interpret,
                               programs_per_sm=kernels.tuning.programs_per_sm)

    def reason(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len):
        return draft_attention_unsupported_reason(q, ctx_k, ctx_k, blk_k, blk_k, causal=causal, window=window,
                                                  interpret=interpret)

    return run_kernel("cuda", "draft attention", (causal, window), local, reason,
                      (q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len), (HEADS,) * 5 + (rows(2), rows(1)),
                      once=once)


def packed_verify_kernel(qkv, k_cache, v_cache, cu_q_lens, starts, *, max_q_len: int, window, kernels: Kernels):
    """``packed_verify_attention`` as :func:`packed_block_attention` (which reads and writes the packed rows
    itself), or None under a mesh (compact mode does not run under one yet; the block kernels' path would shard)
    or where the kernel cannot take the shapes (logged once). A dense layout goes in as windows of whole blocks:
    its slots past a window hold the block's later drafts (finite, causal after the window: static's verify
    attends them too), whose outputs are never used. ``kernels.tuning.packed_short_q_len``: the short tile."""
    if mesh_sizes():
        return None
    interpret = not native("cuda")

    def local(qkv, k_cache, v_cache, cu, start):
        return packed_block_attention(qkv, k_cache, v_cache, cu, start, max_q_len=max_q_len,
                                      short_q_len=kernels.tuning.packed_short_q_len, window=window,
                                      interpret=interpret, programs_per_sm=kernels.tuning.programs_per_sm)

    def reason(qkv, k_cache, v_cache, cu, start):
        return packed_block_unsupported_reason(qkv, k_cache, v_cache, max_q_len=max_q_len, window=window,
                                               interpret=interpret)

    args = (qkv, k_cache, v_cache, cu_q_lens, starts)
    return run_kernel("cuda", "packed verify attention", (window, max_q_len), local, reason, args, unsharded(*args),
                      once=True)


def prefill_attention_kernel(q, k, v, positions, *, sinks=None, window=None, kernels: Kernels):
    """``prefill_attention`` as cuDNN's fused flash attention (``jax.nn.dot_product_attention``) on a GPU backend
    for half-precision inputs without sinks and head size a multiple of 8 up to 128; None elsewhere."""
    h = q.shape[-1]
    if not (native("cuda") and sinks is None and h % 8 == 0 and h <= 128 and q.dtype in (jnp.bfloat16, jnp.float16)):
        return None
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="cudnn")
