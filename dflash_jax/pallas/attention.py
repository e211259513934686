"""TPU (Mosaic) Pallas kernels for the two attention operations of the decode loop.

Both kernels compute exactly what the pure-jnp references in :mod:`dflash_jax.kernels.attention` compute (same masks,
float32 scores/softmax, output in ``q.dtype``); ``tests/test_pallas_tpu.py`` checks them against those
references in TPU interpret mode. Letters: B batch rows (requests), L block/window length, T packed query
rows, N query heads, K KV heads, G = N // K query heads per KV head, H head_dim, S cache slots.

* :func:`draft_attention` — block queries ``q [B,L,N,H]`` over the injected context cache ``ctx_k/ctx_v
  [B,S,K,H]`` (slots ``< ctx_len[b]``) plus the block's own keys ``blk_k/blk_v [B,L,K,H]``, non-causal, or
  causal and/or sliding-window like the reference. **Contract:** the block's positions are consecutive,
  ``q_positions[b] = q_positions[b, 0] + arange(L)`` (the decode loop uses ``ctx_len[b] + arange(L)``); the
  kernel reads only ``q_positions[:, 0]``.
* :func:`ragged_verify_attention` — packed verify windows ``q [T,N,H]`` (request r owns rows
  ``cu_q_lens[r]:cu_q_lens[r+1]``, ℓ_r ≤ ``max_q_len``) attending causally to cache row r up to
  ``kv_lens[r]``; rows at or past ``cu_q_lens[B]`` give zeros. Optionally with gpt-oss's attention sinks
  (``sinks [N]``) and sliding window (``window``), as :func:`dflash_jax.kernels.attention.cache_attention`.

Kernel (shared by both ops): a flash-attention loop with online softmax. Grid ``(B, K // kb, n_kv)``:
batch and KV-head-group axes are "parallel" (megacore / multi-TensorCore sharding), the KV-block axis is
"arbitrary" (it carries the running max ``m``, sum ``l`` and accumulator ``acc`` in float32 VMEM scratch).

* **Queries, GQA grouping.** The wrapper reorders ``q`` (small: B·L·N·H, a cheap XLA transpose) to
  ``[B, K, G·Lp, H]`` with ``Lp = round_up(L, 8)``: all G·Lp query rows of one KV head form one ``[G·Lp, H]``
  tile, so every KV block is DMA'd from HBM once and used by all G query heads of its KV head in one MXU
  matmul. The query block is ``(kb, G·Lp, H)`` — full trailing dims, legal whatever G·Lp is — and stays
  resident across the KV axis (its block index does not change, so it is fetched once per (b, head group)).
* **KV blocks.** The caches keep their ``[B,S,K,H]`` layout: on TPU the minor two dims ``(K, H)`` are the
  tiled ones, so a block must carry whole ``(K, H)`` planes — a ``(block_kv, kb, H)`` block with kb = K
  (default) or a multiple of the sublane tile (8 for 32-bit, 16 for 16-bit dtypes) dividing K. Such a block
  is a contiguous slab of the cache (cheapest DMA). Reordering the cache to ``[B,K,S,H]`` would cost a full
  extra HBM round trip of the cache per call, more than the attention itself. Inside the kernel each KV head
  is read as ``ref[:, h, :]`` → ``[block_kv, H]`` (a sublane-strided VMEM load). ``block_kv`` is a leading
  block dim (no tiling constraint). Default 512: a multiple of 128 so that score tiles ``[G·Lp, block_kv]``
  are lane-dense, large enough to amortise the ~0.35 µs per grid step; halved (down to 128) while the K/V
  double buffers, second-minor dim padded to the sublane tile, exceed 8 MiB; S itself when S is smaller.
  S need not be a multiple of it (the ragged last block is masked).
* **Lengths.** ``ctx_len`` / ``kv_lens`` (clamped to S), the window's first needed block and the number of
  needed blocks are scalar-prefetched into SMEM (``PrefetchScalarGridSpec``). Grid steps past a row's last
  needed block (or, with a sliding window, before its first) skip all compute (``pl.when``) and their
  index_map is clamped to a needed block, so the pipeline sees an unchanged block index and issues no DMA.
* **NaN safety.** Slots at or past a row's length are garbage (possibly NaN). Scores are replaced (``where``,
  not added) with -1e30 where masked, probabilities are selected to 0 where masked, and V rows past the
  length are selected to 0 before the PV matmul (NaN·0 = NaN, so zero probabilities alone would not do).
  Running-max init is the finite -1e30, so fully masked rows never compute ``inf - inf``.
* **Block keys** (draft attention) come as one extra ``(L, kb, H)`` block consumed at the last KV step,
  just before the output is normalised (``acc / l``) and written.
* **Sinks** (ragged verify) are one more key with logit ``sink[n]`` and value 0, seen first: the running max
  starts at the sink and the running sum at 1 (the online rescaling then gives the denominator its
  ``exp(sink - m)``), the accumulator at 0. They arrive lane-replicated like ``m``, a ``[K, G·Lp, 128]``
  float32 input whose ``(kb, G·Lp, 128)`` block (its index follows the head group only: no DMA per KV step)
  initialises ``m`` directly.
* **Sliding windows** mask keys with ``pos - j >= window`` (both ops); blocks wholly before the window of a
  row's first query (the ragged verify: ``kv_len - ℓ``; the draft: ``q_positions[b, 0]``) are skipped.
* **Ragged verify tiling.** The wrapper gathers each request's window into a static tile of ``Lq =
  round_up(max_q_len, 8)`` rows (``[B, K, G·Lq, H]``, an XLA gather of the small q) and scatters the output
  back to the packed ``[T,N,H]`` order. One grid row then reads exactly its own cache row, once, and no
  tile mixes requests; the alternative (fixed tiles over the packed T axis with a scalar-prefetched
  tile→request map) needs a per-tile loop over the requests it straddles and re-reads a request's KV for
  every tile it touches. The gather/scatter moves O(T·N·H) bytes, negligible next to the cache reads.
  ``max_q_len`` is static and defaults to T (always correct, wasteful for B > 1: pass L); rows of a
  window longer than ``max_q_len`` come out NaN (a contract violation made loud instead of silently wrong).

Limits: the grid has ``cdiv(S, block_kv)`` KV steps whatever the lengths (skipped steps cost only the
per-step overhead, no DMA or compute); with B = 1 and kb = K the parallel axes have one point, so a
two-TensorCore chip uses one core (``kv_heads_per_block`` splits heads when K is at least twice the sublane
tile).

Untested on real TPUs (none available to us). The tests run the kernels in TPU interpret mode (semantics,
masking, NaN safety) and lower them to Mosaic MLIR for platform "tpu" (block-shape tiling rules and the
lowering of every primitive), but Mosaic's layout passes and the compiler live in libtpu, so these remain
unverified: the per-head ``ref[:, h, :]`` load from a ``(block_kv, kb, H)`` VMEM block (lowered as a
``[block_kv, 1, H]`` load + shape_cast; with K below the sublane tile — 8 for f32, 16 for bf16 — Mosaic may
need a costly relayout or reject it; alternatives are a strided load from a ``[block_kv·kb, H]`` view, or a
``[B,K,S,H]`` cache layout), lane-sparse small tiles (L-wide block-key scores, H = 64), VMEM sizing
(``vmem_limit_bytes`` is passed through, otherwise the compiler default applies), whether the ragged last
KV block (S not a multiple of ``block_kv``) reads harmless garbage as intended, and all performance. Block
sizes are reasoned, not tuned.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from dflash_jax.kernels.common import HEAD_VECTOR, HEADS, NEG_INF, find_bucket, native, run_kernel
from dflash_jax.kernels.common import rows as row_layout
from dflash_jax.pallas.common import LANES, Interpret, interpret_arg, round_up, sublanes
from dflash_jax.tuning import Kernels

_DEFAULT_BLOCK_KV = 512
_KV_VMEM_BUDGET = 8 * 2**20  # bytes for the double-buffered K and V blocks
_VMEM_HARD_LIMIT = 48 * 2**20  # above this a config cannot fit v7x's 64 MiB VMEM with headroom
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static tiling of one call (see the module docstring)."""

    s: int
    k: int  # KV heads
    g: int  # query heads per KV head
    h: int
    lp: int  # query rows per head, padded to a multiple of 8
    kb: int  # KV heads per block
    block_kv: int
    dtype: Any

    @property
    def rows(self) -> int:
        return self.g * self.lp

    @property
    def n_kv(self) -> int:
        return -(-self.s // self.block_kv)

    def vmem_bytes(self, extra_kv_rows: int = 0, sinks: bool = False) -> int:
        """Rough VMEM need: double-buffered blocks (second-minor dims padded to the sublane tile), scratch,
        the float32 score/probability temporaries, and the lane-replicated sink tile when there is one."""
        isz = jnp.dtype(self.dtype).itemsize
        kb_pad = round_up(self.kb, sublanes(self.dtype))
        rows_pad = round_up(self.rows, sublanes(self.dtype))
        kv = 2 * 2 * (self.block_kv + extra_kv_rows) * kb_pad * self.h * isz
        qo = 2 * 2 * self.kb * rows_pad * self.h * isz
        scratch = self.kb * round_up(self.rows, 8) * (self.h + 2 * LANES) * 4
        temps = 4 * round_up(self.rows, 8) * round_up(self.block_kv, LANES) * 4
        sink = 2 * self.kb * round_up(self.rows, 8) * LANES * 4 if sinks else 0
        return kv + qo + scratch + temps + sink


def _default_block_kv(kb: int, h: int, dtype: Any) -> int:
    per_row = 2 * 2 * round_up(kb, sublanes(dtype)) * h * jnp.dtype(dtype).itemsize
    bkv = _DEFAULT_BLOCK_KV
    while bkv > LANES and bkv * per_row > _KV_VMEM_BUDGET:
        bkv //= 2
    return bkv


def _make_plan(q_rows: int, kv_shape: tuple[int, ...], n: int, dtype: Any, block_kv: int | None,
               kv_heads_per_block: int | None) -> _Plan:
    _, s, k, h = kv_shape
    kb = k if kv_heads_per_block is None else kv_heads_per_block
    bkv = _default_block_kv(kb, h, dtype) if block_kv is None else block_kv
    bkv = min(bkv, s)  # one block covering all of S: block dim equals the array dim
    return _Plan(s=s, k=k, g=n // k, h=h, lp=round_up(max(q_rows, 1), 8), kb=kb, block_kv=bkv,
                 dtype=jnp.dtype(dtype))


def _check(q_shape: tuple[int, ...], q_dtype: Any, kv_shape: tuple[int, ...], kv_dtype: Any, *,
           block_kv: int | None, kv_heads_per_block: int | None, window: int | None = None,
           sinks_shape: tuple[int, ...] | None = None) -> str | None:
    """Reasons that hold in every mode (interpret or compiled)."""
    if len(kv_shape) != 4:
        return f"KV cache must be [B,S,K,H], got shape {kv_shape}"
    _, s, k, h = kv_shape
    n = q_shape[-2]
    if q_shape[-1] != h:
        return f"q head_dim {q_shape[-1]} != KV head_dim {h}"
    if n % k:
        return f"query heads N={n} not a multiple of KV heads K={k}"
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype):
        return f"q dtype {jnp.dtype(q_dtype)} != KV dtype {jnp.dtype(kv_dtype)}"
    if jnp.dtype(q_dtype) not in _SUPPORTED_DTYPES:
        return f"dtype {jnp.dtype(q_dtype)} unsupported (float32 or bfloat16)"
    if s < 1:
        return "empty KV cache (S = 0)"
    if kv_heads_per_block is not None:
        kb, sub = kv_heads_per_block, sublanes(q_dtype)
        if kb != k and (kb <= 0 or k % kb or kb % sub):
            return (f"kv_heads_per_block={kb} must be K={k} or a multiple of {sub} (the {jnp.dtype(q_dtype)} "
                    "sublane tile) dividing K")
    if block_kv is not None and (block_kv <= 0 or (block_kv < s and block_kv % 8)):
        return f"block_kv={block_kv} must be a positive multiple of 8 (or >= S={s})"
    if window is not None and window <= 0:
        return f"window={window} must be positive"
    if sinks_shape is not None and tuple(sinks_shape) != (n,):
        return f"sinks must have shape (N,) = ({n},), got {tuple(sinks_shape)}"
    return None


def unsupported_reason(op: str, q: Any, kv: Any, *, interpret: Interpret = None, block_kv: int | None = None,
                       kv_heads_per_block: int | None = None, window: int | None = None,
                       max_q_len: int | None = None, vmem_limit_bytes: int | None = None,
                       sinks: Any = None) -> str | None:
    """Why ``op`` ("draft" or "ragged_verify") cannot run these shapes as a Pallas TPU kernel, or None.

    ``q`` and ``kv`` are the query and the context/cache K array (arrays or ``jax.ShapeDtypeStruct``; only
    shape and dtype are read); ``sinks`` the ragged verify's per-head sink logits (likewise, or None); the
    keywords are the kernel's static arguments. The caller falls back to the jnp reference when this returns
    a string. Dynamic contracts (consecutive ``q_positions``; ℓ_r ≤ ``max_q_len``) cannot be checked here.
    """
    if op not in ("draft", "ragged_verify"):
        raise ValueError(f"unknown op {op!r} (expected 'draft' or 'ragged_verify')")
    q_shape, kv_shape = tuple(q.shape), tuple(kv.shape)
    want = 4 if op == "draft" else 3
    if len(q_shape) != want:
        return f"{op}: q must have rank {want}, got shape {q_shape}"
    if op == "draft" and sinks is not None:
        return "draft: attention sinks are not supported (only the ragged verify takes them)"
    reason = _check(q_shape, q.dtype, kv_shape, kv.dtype, block_kv=block_kv,
                    kv_heads_per_block=kv_heads_per_block, window=window,
                    sinks_shape=None if sinks is None else tuple(sinks.shape))
    if reason:
        return f"{op}: {reason}"
    if op == "draft" and q_shape[0] != kv_shape[0]:
        return f"draft: q batch {q_shape[0]} != KV batch {kv_shape[0]}"
    if op == "draft" and q_shape[1] < 1:
        return "draft: empty block (L = 0)"
    if op == "ragged_verify" and max_q_len is not None and max_q_len < 1:
        return f"ragged_verify: max_q_len={max_q_len} must be >= 1"
    if interpret_arg(interpret):
        return None  # the interpreter runs any shape; the rest is about compiling with Mosaic
    h = kv_shape[-1]
    if h % 64:
        return f"{op}: head_dim {h} not a multiple of 64 (lane-sparse tiles; untested)"
    q_rows = q_shape[1] if op == "draft" else (max_q_len or q_shape[0])
    plan = _make_plan(q_rows, kv_shape, q_shape[-2], q.dtype, block_kv, kv_heads_per_block)
    extra = q_shape[1] if op == "draft" else 0
    need, limit = plan.vmem_bytes(extra, sinks is not None), vmem_limit_bytes or _VMEM_HARD_LIMIT
    if need > limit:
        return (f"{op}: estimated VMEM {need / 2**20:.1f} MiB > {limit / 2**20:.0f} MiB "
                "(lower block_kv or kv_heads_per_block)")
    if jax.default_backend() != "tpu":
        return f"{op}: Mosaic kernels need a TPU backend (have {jax.default_backend()!r}; pass interpret=...)"
    return None


# ----------------------------------------------------------------------------------------------------------
# Kernel body


def _row_offsets(g: int, lp: int, cols: int) -> jax.Array:
    """[G·Lp, cols] int32: the within-window index l of each query row (rows are ordered (g, l))."""
    return lax.broadcasted_iota(jnp.int32, (g, lp, cols), 1).reshape(g * lp, cols)


def _init_scratch(m_sc, l_sc, acc_sc, sink_ref=None) -> None:
    """Empty softmax state; with sinks, the state of having seen one key of logit ``sink`` and value 0."""
    if sink_ref is None:
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    else:
        m_sc[...] = sink_ref[...]
        l_sc[...] = jnp.ones(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def _online_update(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, v_valid: jax.Array | None,
                   m_ref, l_ref, acc_ref, scale: float) -> None:
    """One online-softmax step for one KV head.

    q [R,H]; k, v [C,H]; visible [R,C] bool; v_valid [C,H] bool (None: every V row is real data);
    m_ref / l_ref [R,128] (lane-replicated, avoids 1-lane layouts) and acc_ref [R,H], all float32.
    """
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible, s, NEG_INF)  # select, not add: garbage K may have produced NaN scores
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_next[:, :1]), 0.0)  # exp(0) = 1 on fully masked rows: zero it
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    if v_valid is not None:
        v = jnp.where(v_valid, v, jnp.zeros_like(v))  # NaN·0 = NaN: garbage V rows must go before the matmul
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv


def _finish(o_ref, l_sc, acc_sc, kb: int) -> None:
    for hh in range(kb):
        l = l_sc[hh][:, :1]
        o_ref[hh] = (acc_sc[hh] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def _kv_step(blk, length, row_pos, q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, *, plan: _Plan,
             window: int | None, causal: bool, scale: float) -> None:
    """Consume KV block ``blk`` (slots blk·block_kv …) for every head of the group."""
    bkv = plan.block_kv
    start = blk * bkv
    col = start + lax.broadcasted_iota(jnp.int32, (plan.rows, bkv), 1)
    visible = col < length
    if causal:
        visible &= col <= row_pos
    if window is not None:
        visible &= row_pos - col < window
    v_valid = start + lax.broadcasted_iota(jnp.int32, (bkv, plan.h), 0) < length
    for hh in range(plan.kb):
        _online_update(q_ref[hh], k_ref[:, hh, :], v_ref[:, hh, :], visible, v_valid,
                       m_sc.at[hh], l_sc.at[hh], acc_sc.at[hh], scale)


def _draft_kernel(ctx_len_ref, pos0_ref, lo_ref, hi_ref,  # scalar prefetch, [B] int32 in SMEM
                  q_ref, ck_ref, cv_ref, bk_ref, bv_ref,  # (kb,R,H), (bkv,kb,H) ×2, (L,kb,H) ×2
                  o_ref, m_sc, l_sc, acc_sc,  # (kb,R,H); scratch (kb,R,128) ×2, (kb,R,H)
                  *, plan: _Plan, blk_len: int, causal: bool, window: int | None, scale: float):
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        _init_scratch(m_sc, l_sc, acc_sc)

    blk = lo_ref[b] + j

    @pl.when(blk < hi_ref[b])
    def _():
        row_pos = pos0_ref[b] + _row_offsets(plan.g, plan.lp, plan.block_kv)
        # Context entries carry no causal term in the reference (they precede the block in the decode loop).
        _kv_step(blk, ctx_len_ref[b], row_pos, q_ref, ck_ref, cv_ref, m_sc, l_sc, acc_sc, plan=plan,
                 window=window, causal=False, scale=scale)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        # The block's own keys sit at the block positions, so masks depend on offsets within the block only.
        lq = _row_offsets(plan.g, plan.lp, blk_len)
        lk = lax.broadcasted_iota(jnp.int32, (plan.rows, blk_len), 1)
        visible = jnp.ones((plan.rows, blk_len), jnp.bool_)
        if causal:
            visible &= lk <= lq
        if window is not None:
            visible &= lq - lk < window
            if not causal:
                visible &= lk - lq < window
        for hh in range(plan.kb):
            _online_update(q_ref[hh], bk_ref[:, hh, :], bv_ref[:, hh, :], visible, None,
                           m_sc.at[hh], l_sc.at[hh], acc_sc.at[hh], scale)
        _finish(o_ref, l_sc, acc_sc, plan.kb)


def _verify_kernel(kv_len_ref, q_len_ref, lo_ref, hi_ref,  # scalar prefetch, [B] int32 in SMEM
                   q_ref, k_ref, v_ref, *refs,  # [sink (kb,R,128) f32], o (kb,R,H); scratch as the draft's
                   plan: _Plan, window: int | None, has_sinks: bool, scale: float):
    sink_ref, (o_ref, m_sc, l_sc, acc_sc) = (refs[0], refs[1:]) if has_sinks else (None, refs)
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        _init_scratch(m_sc, l_sc, acc_sc, sink_ref)

    blk = lo_ref[b] + j

    @pl.when(blk < hi_ref[b])
    def _():
        kv_len = kv_len_ref[b]
        # Window token l sits at kv_len - ℓ + l; padding rows (l ≥ ℓ) are kept off garbage by col < kv_len.
        row_pos = kv_len - q_len_ref[b] + _row_offsets(plan.g, plan.lp, plan.block_kv)
        _kv_step(blk, kv_len, row_pos, q_ref, k_ref, v_ref, m_sc, l_sc, acc_sc, plan=plan, window=window,
                 causal=True, scale=scale)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        _finish(o_ref, l_sc, acc_sc, plan.kb)


# ----------------------------------------------------------------------------------------------------------
# Wrappers


def _group_queries(q: Float[Array, "B L N H"], plan: _Plan) -> Float[Array, "B K R H"]:
    b, l, n, h = q.shape
    q = q.reshape(b, l, plan.k, plan.g, h)
    q = jnp.pad(q, ((0, 0), (0, plan.lp - l), (0, 0), (0, 0), (0, 0)))
    return q.transpose(0, 2, 3, 1, 4).reshape(b, plan.k, plan.rows, h)


def _ungroup_output(o: Float[Array, "B K R H"], l: int, plan: _Plan) -> Float[Array, "B L N H"]:
    b = o.shape[0]
    o = o.reshape(b, plan.k, plan.g, plan.lp, plan.h)[:, :, :, :l]
    return o.transpose(0, 3, 1, 2, 4).reshape(b, l, plan.k * plan.g, plan.h)


def _compiler_params(vmem_limit_bytes: int | None) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                vmem_limit_bytes=vmem_limit_bytes)


def _scratch(plan: _Plan) -> list:
    return [pltpu.VMEM((plan.kb, plan.rows, LANES), jnp.float32),  # running max m
            pltpu.VMEM((plan.kb, plan.rows, LANES), jnp.float32),  # running sum l
            pltpu.VMEM((plan.kb, plan.rows, plan.h), jnp.float32)]  # accumulator


def _raise_if(reason: str | None) -> None:
    if reason:
        raise ValueError(reason)


def _kv_block_index(bi, hg, j, _len_ref, _pos_ref, lo_ref, hi_ref):
    """KV block of grid step (request, head group, j), from the scalar-prefetched [lo, hi) bounds (both
    kernels prefetch (length, position, lo, hi)): steps outside [lo, hi) repeat a needed block index, so the
    pipeline issues no DMA for them."""
    return bi, jnp.minimum(lo_ref[bi] + j, jnp.maximum(hi_ref[bi] - 1, 0)), hg, 0


def _tile_index(bi, hg, j, *_):
    """The request's query / output tile of the head group."""
    return bi, hg, 0, 0


@functools.partial(jax.jit, static_argnames=("causal", "window", "interpret", "block_kv", "kv_heads_per_block",
                                             "vmem_limit_bytes"))
def draft_attention(
    q: Float[Array, "B L N H"],
    ctx_k: Float[Array, "B S K H"],
    ctx_v: Float[Array, "B S K H"],
    blk_k: Float[Array, "B L K H"],
    blk_v: Float[Array, "B L K H"],
    q_positions: Int[Array, "B L"],
    ctx_len: Int[Array, "B"],
    *,
    causal: bool = False,
    window: int | None = None,
    interpret: Interpret = None,
    block_kv: int | None = None,
    kv_heads_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> Float[Array, "B L N H"]:
    """Pallas TPU version of :func:`dflash_jax.kernels.attention.draft_attention` (see the module docstring).

    Requires ``q_positions[b] = q_positions[b, 0] + arange(L)``. ``interpret``: ``pltpu.InterpretParams()``
    (or True) to run on CPU. ``block_kv``: context slots per KV block (default: 512, halved while the K/V
    double buffers exceed 8 MiB). ``kv_heads_per_block``: KV heads per grid step (default K; a sublane-tile
    multiple dividing K gives a parallel head axis).
    """
    _raise_if(_check(q.shape, q.dtype, ctx_k.shape, ctx_k.dtype, block_kv=block_kv,
                     kv_heads_per_block=kv_heads_per_block, window=window))
    b, l, n, h = q.shape
    if l < 1 or ctx_v.shape != ctx_k.shape or blk_k.shape != (b, l, ctx_k.shape[2], h) or blk_v.shape != blk_k.shape:
        raise ValueError(f"inconsistent shapes: q {q.shape}, ctx_k {ctx_k.shape}, ctx_v {ctx_v.shape}, "
                         f"blk_k {blk_k.shape}, blk_v {blk_v.shape}")
    plan = _make_plan(l, ctx_k.shape, n, q.dtype, block_kv, kv_heads_per_block)
    bkv = plan.block_kv
    ctx_len = jnp.clip(ctx_len.astype(jnp.int32), 0, plan.s)
    pos0 = q_positions[:, 0].astype(jnp.int32)
    hi = (ctx_len + bkv - 1) // bkv  # blocks holding any slot < ctx_len
    # With a sliding window no row sees slots before pos0 - window + 1: skip those blocks too.
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(pos0 - window + 1, 0) // bkv

    q_spec = pl.BlockSpec((None, plan.kb, plan.rows, h), _tile_index)
    kv_spec = pl.BlockSpec((None, bkv, plan.kb, h), _kv_block_index)
    blk_spec = pl.BlockSpec((None, l, plan.kb, h), lambda bi, hg, j, *_: (bi, 0, hg, 0))
    kernel = functools.partial(_draft_kernel, plan=plan, blk_len=l, causal=causal, window=window,
                               scale=h ** -0.5)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, plan.k // plan.kb, plan.n_kv),
            in_specs=[q_spec, kv_spec, kv_spec, blk_spec, blk_spec], out_specs=q_spec,
            scratch_shapes=_scratch(plan)),
        out_shape=jax.ShapeDtypeStruct((b, plan.k, plan.rows, h), q.dtype),
        compiler_params=_compiler_params(vmem_limit_bytes),
        interpret=interpret_arg(interpret),
        name="dflash_draft_attention",
    )(ctx_len, pos0, lo.astype(jnp.int32), hi.astype(jnp.int32), _group_queries(q, plan), ctx_k, ctx_v,
      blk_k, blk_v)
    return _ungroup_output(out, l, plan)


@functools.partial(jax.jit, static_argnames=("max_q_len", "window", "interpret", "block_kv", "kv_heads_per_block",
                                             "vmem_limit_bytes"))
def ragged_verify_attention(
    q: Float[Array, "T N H"],
    k_cache: Float[Array, "B S K H"],
    v_cache: Float[Array, "B S K H"],
    cu_q_lens: Int[Array, "B+1"],
    kv_lens: Int[Array, "B"],
    sinks: Float[Array, "N"] | None = None,
    *,
    max_q_len: int | None = None,
    window: int | None = None,
    interpret: Interpret = None,
    block_kv: int | None = None,
    kv_heads_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> Float[Array, "T N H"]:
    """Pallas TPU version of :func:`dflash_jax.kernels.attention.ragged_verify_attention` (see the module docstring).

    ``max_q_len``: static bound on every window length ℓ_r (default T; pass the block size L). Rows of a
    longer window come out NaN. ``sinks``: a logit per query head that joins every softmax denominator and
    carries no value (gpt-oss). ``window``: a query at position p sees keys ``p - window < j <= p``. Other
    keywords as :func:`draft_attention`.
    """
    _raise_if(_check(q.shape, q.dtype, k_cache.shape, k_cache.dtype, block_kv=block_kv,
                     kv_heads_per_block=kv_heads_per_block, window=window,
                     sinks_shape=None if sinks is None else sinks.shape))
    t, n, _ = q.shape
    b = k_cache.shape[0]
    if t < 1 or v_cache.shape != k_cache.shape or cu_q_lens.shape != (b + 1,) or kv_lens.shape != (b,):
        raise ValueError(f"inconsistent shapes: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}, "
                         f"cu_q_lens {cu_q_lens.shape}, kv_lens {kv_lens.shape}")
    if max_q_len is not None and max_q_len < 1:
        raise ValueError(f"max_q_len={max_q_len} must be >= 1")
    lq = t if max_q_len is None else max_q_len
    plan = _make_plan(lq, k_cache.shape, n, q.dtype, block_kv, kv_heads_per_block)
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, plan.s)
    # Gather each request's window into its own static tile of lq rows (module docstring: ragged tiling).
    rows = jnp.clip(cu[:-1, None] + jnp.arange(lq)[None, :], 0, t - 1)  # [B, lq]
    out = _ragged_call(_group_queries(q[rows], plan), k_cache, v_cache, q_lens, kv_lens, sinks, plan=plan,
                       window=window, interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)
    return _to_packed(_ungroup_output(out, lq, plan), cu, t).astype(q.dtype)


def _ragged_call(q_tiles, k_cache, v_cache, q_lens: Int[Array, "B"], kv_lens: Int[Array, "B"], sinks, *, plan,
                 window: int | None, interpret: Interpret, vmem_limit_bytes: int | None) -> jax.Array:
    """The kernel over grid (request, KV-head group, KV block): [B, K, rows, H] tiles out."""
    b, h, bkv = k_cache.shape[0], k_cache.shape[-1], plan.block_kv
    hi = jnp.where(q_lens > 0, (kv_lens + bkv - 1) // bkv, 0)  # empty windows read nothing
    # With a sliding window no row sees slots before its first query's window (at kv_len - ℓ): skip them.
    lo = jnp.zeros_like(hi) if window is None else jnp.where(
        q_lens > 0, jnp.maximum(kv_lens - q_lens - window + 1, 0) // bkv, 0)

    q_spec = pl.BlockSpec((None, plan.kb, plan.rows, h), _tile_index)
    kv_spec = pl.BlockSpec((None, bkv, plan.kb, h), _kv_block_index)
    in_specs, extra = [q_spec, kv_spec, kv_spec], []
    if sinks is not None:
        # Lane-replicated like the running max it initialises: [K, R, 128], row (g, l) holds sink[k·G + g].
        tile = jnp.repeat(sinks.astype(jnp.float32).reshape(plan.k, plan.g), plan.lp, axis=1)
        extra = [jnp.broadcast_to(tile[:, :, None], (plan.k, plan.rows, LANES))]
        in_specs.append(pl.BlockSpec((plan.kb, plan.rows, LANES), lambda bi, hg, j, *_: (hg, 0, 0)))
    kernel = functools.partial(_verify_kernel, plan=plan, window=window, has_sinks=sinks is not None,
                               scale=h ** -0.5)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, plan.k // plan.kb, plan.n_kv),
            in_specs=in_specs, out_specs=q_spec, scratch_shapes=_scratch(plan)),
        out_shape=jax.ShapeDtypeStruct((b, plan.k, plan.rows, h), q_tiles.dtype),
        compiler_params=_compiler_params(vmem_limit_bytes),
        interpret=interpret_arg(interpret),
        name="dflash_ragged_verify_attention",
    )(kv_lens, q_lens, lo.astype(jnp.int32), hi.astype(jnp.int32), q_tiles, k_cache, v_cache, *extra)


def _to_packed(out: Float[Array, "B Lq N H"], cu: Int[Array, "B+1"], t: int) -> Float[Array, "T N H"]:
    """Each request's tile rows back to the packed order: token t belongs to the last request whose window
    starts at or before t; padding tokens give 0, rows of a window longer than Lq NaN (loud)."""
    b, lq = out.shape[:2]
    tok = jnp.arange(t)
    req = jnp.clip(find_bucket(cu, tok, side="right") - 1, 0, b - 1)
    off = tok - cu[req]
    vals = jnp.where((off >= lq)[:, None, None], jnp.nan, out[req, jnp.minimum(off, lq - 1)])
    return jnp.where((tok < cu[b])[:, None, None], vals, 0)


# ----------------------------------------------------------------------------------------------------------
# Entries of the kernel dispatch (dflash_jax.kernels.dispatch: each takes its op's arguments and returns None
# where the reference must run). On a TPU each kernel is compiled alone first (kernels.common.compile_probe).


def _interpret() -> Interpret:
    return None if native("pallas") else pltpu.InterpretParams()


def cache_attention_kernel(q, k_cache, v_cache, q_positions, *, sinks=None, window=None, kernels: Kernels):
    """``cache_attention`` of consecutive windows as :func:`ragged_verify_attention` (ℓ_r = T for every row)."""
    interp = _interpret()

    def local(q, k_cache, v_cache, q_positions, sinks=None):
        b, t, n, h = q.shape
        cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * t)  # a constant: no kernel per layer each step
        kv_lens = (q_positions[:, -1] + 1).astype(jnp.int32)
        out = ragged_verify_attention(q.reshape(b * t, n, h), k_cache, v_cache, cu, kv_lens, sinks, max_q_len=t,
                                      window=window, interpret=interp)
        return out.reshape(q.shape)

    def reason(q, k_cache, v_cache, q_positions, sinks=None):
        b, t, n, h = q.shape
        return unsupported_reason("ragged_verify", jax.ShapeDtypeStruct((b * t, n, h), q.dtype), k_cache,
                                  interpret=interp, max_q_len=t, window=window, sinks=sinks)

    heads = () if sinks is None else (sinks,)
    return run_kernel("pallas", "verify attention", (window,), local, reason, (q, k_cache, v_cache, q_positions,
                                                                              *heads),
                      (HEADS, HEADS, HEADS, row_layout(2)) + (HEAD_VECTOR,) * len(heads), probe=native("pallas"))


def draft_attention_kernel(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len, *, causal: bool, window,
                           kernels: Kernels, once: bool = False):
    """``draft_attention`` (no sinks) as :func:`draft_attention`."""
    interp = _interpret()

    def local(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len):
        return draft_attention(q, ctx_k, ctx_v, blk_k, blk_v, q_positions.astype(jnp.int32),
                               ctx_len.astype(jnp.int32), causal=causal, window=window, interpret=interp)

    def reason(q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len):
        return unsupported_reason("draft", q, ctx_k, interpret=interp, window=window)

    return run_kernel("pallas", "draft attention", (causal, window), local, reason,
                      (q, ctx_k, ctx_v, blk_k, blk_v, q_positions, ctx_len),
                      (HEADS,) * 5 + (row_layout(2), row_layout(1)), once=once, probe=native("pallas"))
