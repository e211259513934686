"""GPU grouped-expert MLP (Pallas → Triton): the routed experts' SwiGLU for a few tokens, reading only the
weights of experts some token routed to.

Same semantics and signature as :func:`dflash_jax.kernels.moe.experts_gathered` (the jnp reference):
``x [N, D]``, routing ``weights``/``idx [N, K]``, experts ``gate``/``up [E, D, F]``, ``down [E, F, D]``,
optional gpt-oss ``biases`` and any elementwise ``act(g, u)`` (computed in float32 here). P = N·K pairs.

Why: at decode sizes XLA's paths read far more than the routed experts' weights (bf16, E=128, D=2048, F=768,
K=8: ``ragged_dot`` read more than all 128 experts for one token, the gathered einsum ~15× the routed bytes).
Decode is memory-bound, so the goal is to stream exactly the routed experts' weights once, with enough programs
in flight to fill the HBM pipe.

:func:`grouped_experts` picks one of two forms by the call's tokens: :func:`pair_experts` up to
:data:`PAIR_MAX_TOKENS` (one token: the pairs are distinct experts, so GEMV kernels over the pairs as routed
need no grouping and skip its small XLA ops: about 30 % less time than grouping), :func:`sorted_experts` above
(described next: from two tokens on, reading a shared expert once pays for the grouping).

Layout: the P (token, expert) pairs are sorted by expert (:func:`dflash_jax.kernels.moe.group_pairs`, a few
small XLA ops) and each pair's token row is copied to ``xs [P, D]`` in that order, so an expert's rows are
contiguous. Group g (g < G = min(E, P), one per routed expert; idle groups have count 0 and return at once)
owns rows ``start[g] : start[g] + count[g]`` — count ≤ N since a token routes an expert once, so for N ≤ 64
a group is one tile of ``rows`` = clamp(next_pow2(N), 16, 64) rows (``tl.dot`` needs 16; padding rows load
zeros and are never stored; larger N loops over row tiles).

Two kernels:

* **gate/up** — grid ``(G, F / block_f, splits)``: a program reads ``gate[e]`` and ``up[e]`` columns
  ``[f0, f0 + block_f)`` for its split's D rows (``block_d`` rows per loop step, software-pipelined) and
  writes float32 partial sums ``[splits, P, F]``. A D split adds parallelism for one token (K=8 groups × 12
  column blocks), but measured it cost more partial-sum traffic than it gained: off by default.
* **down** — grid ``(G, D / block_n)``: a program sums the splits' partials for its rows, adds the biases,
  applies ``act`` in float32, casts to the weights' dtype and multiplies by ``down[e]`` rows ``[f0, f0 +
  block_k)`` × columns ``[d0, d0 + block_n)``, looping over all of F; adds the down bias and writes
  ``ys [P, D]`` (x's dtype, like the reference's per-expert outputs).

XLA then puts ``ys`` back in (token, slot) order and applies the routing weights (the reference's
``combine``). Each routed expert's weights are read once (the partials and ``xs`` are ~1% of the bytes at
decode sizes); no program touches an unrouted expert. Defaults (64-wide blocks, 4 warps, 3 stages) are
reasoned, not swept: ``benchmarks/bench_moe.py --sweep`` times alternatives.

Quantized experts (``quant``, :class:`dflash_jax.kernels.moe.ExpertScales`: int8 / float8_e4m3fn values, each
expert's float32 block scales ``[E, nbi, nbo]``) run :func:`pair_experts` for calls of at most E (token, expert)
pairs, which read no more weight sets than there are experts; larger calls (a wide verify, a prefill) keep the
references unless ``KernelTuning.moe_quantized_sorted`` sends them to :func:`sorted_experts`, whose tiles load the
values as stored and convert them in registers for the tensor-core dot. The
pair kernels then load each routed expert's tiles as stored (1 byte a value), convert them to float32 in
registers (exact) and never write a dequantized expert; scales as :mod:`dflash_jax.cuda.quantized` applies them
(shared: :class:`dflash_jax.cuda.quantized.Scaling`): per loop step when the expert's input rows (D for gate/up,
F for down) have several row blocks — the step's rows inside one block — else once on the sums. Tiles are
narrowed to fit inside scale blocks; float8 needs ``sm_89`` or newer, and its ragged tiles load without a fill
value (that module's docstring). The sorted (tensor-core) kernels read float experts only.

Float32 inputs follow JAX's default matmul precision (TF32, or IEEE under "highest"), as in
:mod:`dflash_jax.cuda`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.cuda.common import SUPPORTED_DTYPES, cdiv, highest_precision_requested, next_pow2, num_sms
from dflash_jax.cuda.quantized import Scaling, fit_scale_blocks, weight_reason
from dflash_jax.kernels.common import log_once, mesh_sizes, native
from dflash_jax.kernels.moe import (Biases, ExpertScales, argument_reason, combine, group_pairs, run_grouped,
                                    swiglu)
from dflash_jax.tuning import Kernels

__all__ = ["experts_kernel", "grouped_experts", "pair_experts", "sorted_experts", "unsupported_reason"]

# Gate/up kernel of sorted_experts: D splits until ~``programs_per_sm`` programs per SM (routed groups × blocks), at
# least _MIN_SPLIT_ROWS rows each. Off by default (0): one token took a third longer with 6 splits than unsplit
# (``benchmarks/bench_moe.py --sweep``); `num_splits=` still tunes it.
_MIN_SPLIT_ROWS = 256


@dataclasses.dataclass(frozen=True)
class _Config:
    rows: int  # pair rows per tile (power of two, >= 16)
    block_f: int  # gate/up: F columns per program
    block_d: int  # gate/up: D rows per loop step
    splits: int  # gate/up: D splits (programs), summed by the down kernel
    chunk_d: int  # gate/up: D rows per split (a multiple of block_d)
    block_n: int  # down: D columns per program
    block_k: int  # down: F rows per loop step
    num_warps: int
    num_stages: int
    ieee_f32: bool
    gate_up: Scaling | None = None  # quantized experts: how gate/up's [D, F] values meet their scales
    down: Scaling | None = None  # ... and down's [F, D]


def _block(size: int | None, default: int, extent: int) -> int:
    """A power-of-two block of at least 16 (tl.dot's minimum), never much larger than the extent."""
    b = next_pow2(size or default)
    return max(16, min(b, next_pow2(extent)))


def _d_splits(num_splits: int | None, per_sm: int, programs: int, d: int, block_d: int) -> tuple[int, int]:
    """(splits, rows per split) of the gate/up kernels' D: ``num_splits``, or by default enough splits for
    ~``per_sm`` programs per SM over the grid's other ``programs``, each at least _MIN_SPLIT_ROWS rows; a split
    is a whole number of ``block_d`` steps."""
    if num_splits is None:
        num_splits = max(1, min(cdiv(per_sm * num_sms(), programs), d // _MIN_SPLIT_ROWS))
    num_splits = max(1, min(num_splits, cdiv(d, block_d)))
    chunk = cdiv(cdiv(d, num_splits), block_d) * block_d
    return cdiv(d, chunk), chunk


def _sorted_tiles(d: int, f: int, quant: ExpertScales | None, block_f, block_d, block_n, block_k
                  ) -> tuple[int, int, int, int]:
    """(block_f, block_d, block_n, block_k) of the sorted kernels: 64 by default, powers of two ≥ 16 no wider
    than needed; for quantized experts each tile inside one scale block where the scales have several (as
    :func:`_pair_tiles`)."""
    bf, bd, bn, bk = _block(block_f, 64, f), _block(block_d, 64, d), _block(block_n, 64, d), _block(block_k, 64, f)
    if quant is not None:
        bd, bf = fit_scale_blocks(d, quant.gate_up_block, bd, bf)
        bk, bn = fit_scale_blocks(f, quant.down_block, bk, bn)
    return bf, bd, bn, bk


def _make_config(n: int, groups: int, d: int, f: int, dtype, *, block_f, block_d, num_splits, block_n, block_k,
                 num_warps, num_stages, programs_per_sm: int = 0, quant: ExpertScales | None = None,
                 q_dtypes: tuple = ()) -> _Config:
    rows = min(max(next_pow2(n), 16), 64)
    bf, bd, bn, bk = _sorted_tiles(d, f, quant, block_f, block_d, block_n, block_k)
    splits, chunk = _d_splits(num_splits, programs_per_sm, groups * cdiv(f, bf), d, bd)
    scaling = {} if quant is None else dict(gate_up=Scaling.of(d, quant.gate_up_block, q_dtypes[0]),
                                            down=Scaling.of(f, quant.down_block, q_dtypes[1]))
    return _Config(rows=rows, block_f=bf, block_d=bd, splits=splits, chunk_d=chunk, block_n=bn, block_k=bk,
                   num_warps=num_warps or 4, num_stages=num_stages or 3,
                   ieee_f32=jnp.dtype(dtype) == jnp.float32 and highest_precision_requested(), **scaling)


def _dot(a: jax.Array, b: jax.Array, c: _Config) -> jax.Array:
    prec = lax.Precision.HIGHEST if c.ieee_f32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _and(*masks):
    """Conjunction of the masks that exist (None: every element of that axis is in bounds)."""
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _load(ref, mask):
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _tail_mask(start, block: int, extent: int):
    """[block] mask of indices < extent, or None when blocks tile the extent exactly."""
    return None if extent % block == 0 else start + jnp.arange(block) < extent


def _over_row_tiles(start, count, rows: int, tile: Callable) -> None:
    """``tile(r0, row_mask)`` for each tile of ``rows`` rows of the group (one tile while count <= rows)."""

    def body(r, carry):
        tile(start + r * rows, jnp.arange(rows) < count - r * rows)
        return carry

    lax.fori_loop(0, lax.div(count + rows - 1, rows), body, None)  # no carry: Triton cannot yield literals


def _gate_up_kernel(expert_ref, start_ref, count_ref, xs_ref, gate_ref, up_ref, *refs, c: _Config, d: int, f: int):
    # expert/start/count [G]; xs [P, D]; gate/up [E, D, F]; [quantized: their scales [E, nbi, nbo] float32];
    # pg/pu [splits, P, F] float32.
    # Program ids are read outside the pl.when body (interpret mode cannot lower them inside a cond).
    *scale_refs, pg_ref, pu_ref = refs
    q = c.gate_up
    g, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e, count = expert_ref[g], count_ref[g]
    f0 = j * c.block_f
    fmask = _tail_mask(f0, c.block_f, f)
    d_lo = s * c.chunk_d
    steps = lax.div(jnp.minimum(c.chunk_d, d - d_lo) + c.block_d - 1, c.block_d)
    scale = lambda part, s_ref, kb: q.scaled(part, s_ref, (e,), kb, f0, c.block_f, fmask)  # noqa: E731

    def tile(r0, rmask):
        def step(i, acc):
            d0 = d_lo + i * c.block_d
            dmask = _tail_mask(d0, c.block_d, d)
            x = _load(xs_ref.at[pl.ds(r0, c.rows), pl.ds(d0, c.block_d)],
                      _and(rmask[:, None], None if dmask is None else dmask[None, :]))
            wmask = _and(None if dmask is None else dmask[:, None], None if fmask is None else fmask[None, :])
            out = []
            for a, ref, s_ref in zip(acc, (gate_ref, up_ref), scale_refs or (None, None)):
                tile_ref = ref.at[e, pl.ds(d0, c.block_d), pl.ds(f0, c.block_f)]
                # quantized: the values as stored, converted in registers (exact) for the tensor-core dot
                w = _load(tile_ref, wmask) if q is None else q.weights(tile_ref, wmask, xs_ref.dtype)
                part = _dot(x, w, c)
                out.append(a + (scale(part, s_ref, d0 // q.bi) if q is not None and q.per_step else part))
            return tuple(out)

        zero = jnp.zeros((c.rows, c.block_f), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, steps, step, (zero, zero))
        if q is not None and not q.per_step:  # one row block: the scales once (linear over the D splits)
            acc_g, acc_u = (scale(a, s_ref, jnp.int32(0)) for a, s_ref in zip((acc_g, acc_u), scale_refs))
        omask = _and(rmask[:, None], None if fmask is None else fmask[None, :])
        plgpu.store(pg_ref.at[s, pl.ds(r0, c.rows), pl.ds(f0, c.block_f)], acc_g, mask=omask)
        plgpu.store(pu_ref.at[s, pl.ds(r0, c.rows), pl.ds(f0, c.block_f)], acc_u, mask=omask)

    @pl.when(count > 0)
    def _():
        _over_row_tiles(start_ref[g], count, c.rows, tile)


def _down_kernel(expert_ref, start_ref, count_ref, pg_ref, pu_ref, down_ref, *refs, c: _Config, d: int, f: int,
                 act: Callable, has_bias: bool):
    # pg/pu [splits, P, F] float32; down [E, F, D]; [quantized: its scales [E, nbi, nbo] float32]; [bias_g, bias_u
    # [E, F], bias_d [E, D]]; ys [P, D].
    *refs, ys_ref = refs
    q = c.down
    s_ref, bias_refs = (refs[0], refs[1:]) if q is not None else (None, refs)
    g, j = pl.program_id(0), pl.program_id(1)
    e, count = expert_ref[g], count_ref[g]
    d0 = j * c.block_n
    dmask = _tail_mask(d0, c.block_n, d)
    scale = lambda part, kb: q.scaled(part, s_ref, (e,), kb, d0, c.block_n, dmask)  # noqa: E731

    def tile(r0, rmask):
        def step(i, acc):
            k0 = i * c.block_k
            kmask = _tail_mask(k0, c.block_k, f)
            hmask = _and(rmask[:, None], None if kmask is None else kmask[None, :])
            part = lambda ref: functools.reduce(jnp.add, (  # noqa: E731 — the splits' partial sums
                _load(ref.at[jnp.int32(s), pl.ds(r0, c.rows), pl.ds(k0, c.block_k)], hmask) for s in range(c.splits)))
            hg, hu = part(pg_ref), part(pu_ref)
            if has_bias:
                hg = hg + _load(bias_refs[0].at[e, pl.ds(k0, c.block_k)], kmask).astype(jnp.float32)[None, :]
                hu = hu + _load(bias_refs[1].at[e, pl.ds(k0, c.block_k)], kmask).astype(jnp.float32)[None, :]
            # Columns past F hold act(0, 0) (0 for SwiGLU and gpt-oss's), padding rows are never stored,
            # and the matching down rows load as 0: nothing out of bounds reaches an output.
            # (quantized: the hidden in x's dtype, as the reference's, against the values converted to it)
            h = act(hg, hu).astype(down_ref.dtype if q is None else ys_ref.dtype)
            wmask = _and(None if kmask is None else kmask[:, None], None if dmask is None else dmask[None, :])
            tile_ref = down_ref.at[e, pl.ds(k0, c.block_k), pl.ds(d0, c.block_n)]
            part = _dot(h, _load(tile_ref, wmask) if q is None else q.weights(tile_ref, wmask, ys_ref.dtype), c)
            return acc + (scale(part, k0 // q.bi) if q is not None and q.per_step else part)

        acc = lax.fori_loop(0, cdiv(f, c.block_k), step, jnp.zeros((c.rows, c.block_n), jnp.float32))
        if q is not None and not q.per_step:
            acc = scale(acc, jnp.int32(0))
        if has_bias:
            acc = acc + _load(bias_refs[2].at[e, pl.ds(d0, c.block_n)], dmask).astype(jnp.float32)[None, :]
        plgpu.store(ys_ref.at[pl.ds(r0, c.rows), pl.ds(d0, c.block_n)], acc.astype(ys_ref.dtype),
                    mask=_and(rmask[:, None], None if dmask is None else dmask[None, :]))

    @pl.when(count > 0)
    def _():
        _over_row_tiles(start_ref[g], count, c.rows, tile)


# --------------------------------------------------------------------------------------------------
# Per-pair kernels: decode at one token (or a few), where grouping costs more than it saves
# --------------------------------------------------------------------------------------------------

# grouped_experts hands calls of at most this many tokens to pair_experts: from two tokens on, reading a shared
# expert once pays for the grouping (``benchmarks/bench_moe.py``; figures on benchmarks/README.md).
PAIR_MAX_TOKENS = 1


@dataclasses.dataclass(frozen=True)
class _PairConfig:
    block_f: int  # gate/up: F columns per program
    block_d: int  # gate/up: D rows per loop step
    splits: int  # gate/up: D splits (programs) whose partial sums the down kernel adds
    chunk_d: int  # gate/up: D rows per split
    block_n: int  # down: D columns per program
    block_k: int  # down: F rows per loop step
    num_warps: int
    num_stages: int
    gate_up: Scaling | None = None  # quantized experts: how gate/up's [D, F] values meet their scales
    down: Scaling | None = None  # ... and down's [F, D]


def _pair_form(idx, num_experts: int) -> bool:
    """Whether quantized experts run :func:`pair_experts` (at most E (token, expert) pairs, which read no more
    weight sets than there are experts) rather than :func:`sorted_experts`. Arrays or ShapeDtypeStructs."""
    return math.prod(idx.shape) <= num_experts


def _pair_tiles(d: int, f: int, quant: ExpertScales | None, block_f, block_d, block_n, block_k
                ) -> tuple[int, int, int, int]:
    """(block_f, block_d, block_n, block_k) of the pair kernels: the defaults (32-wide F blocks, 128 D rows, 64
    D columns, 128 F rows per down step), powers of two ≥ 16 no wider than needed; for quantized experts each
    tile inside one scale block where the scales have several (:func:`dflash_jax.cuda.quantized.
    fit_scale_blocks`: below 16 :func:`unsupported_reason` says no)."""
    bf, bd = _block(block_f, 32, f), _block(block_d, 128, d)
    bn, bk = _block(block_n, 64, d), _block(block_k, 128, f)
    if quant is not None:
        bd, bf = fit_scale_blocks(d, quant.gate_up_block, bd, bf)
        bk, bn = fit_scale_blocks(f, quant.down_block, bk, bn)
    return bf, bd, bn, bk


def _pair_weights(ref, e, r0, rows: int, rmask, c0, cols: int, cmask, q: Scaling | None) -> jax.Array:
    """Expert ``e``'s weight tile, rows ``[r0, r0 + rows)`` × columns ``[c0, c0 + cols)``, in float32 with zeros
    outside the matrix; quantized (``q``): the values as stored (1 byte each), converted in registers (exact)."""
    wmask = _and(None if rmask is None else rmask[:, None], None if cmask is None else cmask[None, :])
    tile = ref.at[e, pl.ds(r0, rows), pl.ds(c0, cols)]
    if q is None:
        return _load(tile, wmask).astype(jnp.float32)
    return q.weights(tile, wmask, jnp.float32)


def _pair_gate_up(x_ref, e, t, gate_ref, up_ref, scale_refs, f0, d_lo, steps, c: _PairConfig, d: int, f: int):
    """x[t] · gate[e] and x[t] · up[e] over D rows [d_lo, d_lo + steps·block_d) for F columns [f0, f0 +
    block_f), float32: a GEMV (one row fills no tensor-core tile) as multiply-adds into ``[block_d, block_f]``
    accumulators, reduced over D once at the end (a reduction across threads per loop step cost ~2×).
    Quantized experts (``c.gate_up``, ``scale_refs`` their ``[E, nbi, nbo]`` scales): as
    :mod:`dflash_jax.cuda.quantized`'s one-token path, each step's products scaled before they are added when D
    has several row blocks, else the sums once."""
    q = c.gate_up
    fmask = _tail_mask(f0, c.block_f, f)
    scale = lambda part, s_ref, kb: q.scaled(part, s_ref, (e,), kb, f0, c.block_f, fmask)  # noqa: E731

    def step(i, acc):
        d0 = d_lo + i * c.block_d
        dmask = _tail_mask(d0, c.block_d, d)
        xv = _load(x_ref.at[t, pl.ds(d0, c.block_d)], dmask).astype(jnp.float32)[:, None]
        out = []
        for a, ref, s_ref in zip(acc, (gate_ref, up_ref), scale_refs or (None, None)):
            part = xv * _pair_weights(ref, e, d0, c.block_d, dmask, f0, c.block_f, fmask, q)
            out.append(a + (scale(part, s_ref, d0 // q.bi) if q is not None and q.per_step else part))
        return tuple(out)

    zero = jnp.zeros((c.block_d, c.block_f), jnp.float32)
    acc_g, acc_u = lax.fori_loop(0, steps, step, (zero, zero))
    sums = jnp.sum(acc_g, axis=0), jnp.sum(acc_u, axis=0)
    if q is not None and not q.per_step:  # one row block: the scales applied once (linear over the D splits)
        sums = tuple(scale(v, s_ref, jnp.int32(0)) for v, s_ref in zip(sums, scale_refs))
    return sums


def _pair_act(hg, hu, bias_refs, e, k0, block: int, kmask, act: Callable, dtype):
    """act of the gate/up sums (plus biases), in float32, rounded to x's dtype as the reference's hidden is;
    columns past F hold act(bias-free 0, 0) = 0 and meet down rows loaded as 0."""
    if bias_refs:
        hg = hg + _load(bias_refs[0].at[e, pl.ds(k0, block)], kmask).astype(jnp.float32)
        hu = hu + _load(bias_refs[1].at[e, pl.ds(k0, block)], kmask).astype(jnp.float32)
    return act(hg, hu).astype(dtype).astype(jnp.float32)


def _pair_gate_up_kernel(idx_ref, x_ref, gate_ref, up_ref, *refs, c: _PairConfig, d: int, f: int, k: int):
    # idx [P] (pair p = token p // K); x [N, D]; gate/up [E, D, F]; [scales of gate, up [E, nbi, nbo] float32];
    # pg/pu [splits, P, F] float32.
    *scale_refs, pg_ref, pu_ref = refs
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f0, d_lo = j * c.block_f, s * c.chunk_d
    steps = lax.div(jnp.minimum(c.chunk_d, d - d_lo) + c.block_d - 1, c.block_d)
    acc_g, acc_u = _pair_gate_up(x_ref, idx_ref[p], p // k, gate_ref, up_ref, scale_refs, f0, d_lo, steps, c, d, f)
    fmask = _tail_mask(f0, c.block_f, f)
    plgpu.store(pg_ref.at[s, p, pl.ds(f0, c.block_f)], acc_g, mask=fmask)
    plgpu.store(pu_ref.at[s, p, pl.ds(f0, c.block_f)], acc_u, mask=fmask)


def _pair_down_kernel(idx_ref, pg_ref, pu_ref, down_ref, *refs, c: _PairConfig, d: int, f: int, act: Callable):
    # pg/pu [splits, P, F] float32; down [E, F, D]; [its scales [E, nbi, nbo] float32]; [bias_g, bias_u [E, F],
    # bias_d [E, D]]; ys [P, D].
    *refs, ys_ref = refs
    q = c.down
    s_ref, bias_refs = (refs[0], refs[1:]) if q is not None else (None, refs)
    p, j = pl.program_id(0), pl.program_id(1)
    e, d0 = idx_ref[p], j * c.block_n
    dmask = _tail_mask(d0, c.block_n, d)
    scale = lambda part, kb: q.scaled(part, s_ref, (e,), kb, d0, c.block_n, dmask)  # noqa: E731

    def step(i, acc):
        k0 = i * c.block_k
        kmask = _tail_mask(k0, c.block_k, f)
        part = lambda ref: functools.reduce(jnp.add, (  # noqa: E731 — the splits' partial sums
            _load(ref.at[jnp.int32(s), p, pl.ds(k0, c.block_k)], kmask) for s in range(c.splits)))
        h = _pair_act(part(pg_ref), part(pu_ref), bias_refs, e, k0, c.block_k, kmask, act, ys_ref.dtype)
        prod = h[:, None] * _pair_weights(down_ref, e, k0, c.block_k, kmask, d0, c.block_n, dmask, q)
        return acc + (scale(prod, k0 // q.bi) if q is not None and q.per_step else prod)

    acc = lax.fori_loop(0, cdiv(f, c.block_k), step, jnp.zeros((c.block_k, c.block_n), jnp.float32))
    acc = jnp.sum(acc, axis=0)  # over F once (see _pair_gate_up)
    if q is not None and not q.per_step:
        acc = scale(acc, jnp.int32(0))
    if bias_refs:
        acc = acc + _load(bias_refs[2].at[e, pl.ds(d0, c.block_n)], dmask).astype(jnp.float32)
    plgpu.store(ys_ref.at[p, pl.ds(d0, c.block_n)], acc.astype(ys_ref.dtype), mask=dmask)


def pair_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                 down: jax.Array, *, biases: Biases | None = None, act: Callable = swiglu,
                 quant: ExpertScales | None = None, block_f: int | None = None, block_d: int | None = None,
                 num_splits: int | None = None, block_n: int | None = None, block_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False,
                 programs_per_sm: int = 0) -> jax.Array:
    """:func:`grouped_experts` for a token or a few, one program row per (token, expert) pair, no grouping.

    At one token the pairs are distinct experts, so nothing is read twice, and the grouping's sort, the
    expert-ordered copy of x and its inverse (a handful of small XLA kernels, each a launch on a step that is
    ~20 µs of weight traffic) are skipped; with N tokens an expert routed by several of them is read once per
    pair. The products are GEMVs (multiply + column sum in float32), not 16-row tensor-core tiles.

    Two kernels: gate/up over grid ``(P, F / block_f, splits)`` writing float32 partial sums ``[splits, P, F]``,
    then down over ``(P, D / block_n)``, which adds the splits, applies ``act`` and writes ``ys [P, D]``. (One
    kernel per (pair, F block) reading all three matrices' slices, leaving D-wide partial outputs, saved only
    ~4 % against two kernels reducing across threads every loop step; reducing once after the loop instead
    made the two kernels ~25 % faster than that single kernel, which was not retried with it.) Tuning as
    :func:`sorted_experts` (``block_k``: F rows per down step; defaults in :func:`_pair_tiles`, ~4 programs
    per SM in D splits — ``programs_per_sm`` when not 0: the best of ``benchmarks/bench_moe.py --sweep``).

    ``quant``: quantized experts (``gate``/``up``/``down`` int8 / float8_e4m3fn values, module docstring)."""
    n, k = idx.shape
    e, d, f = gate.shape
    p = n * k
    bf, bd, bn, bk = _pair_tiles(d, f, quant, block_f, block_d, block_n, block_k)
    splits, chunk = _d_splits(num_splits, programs_per_sm or 4, p * cdiv(f, bf), d, bd)
    scaling = {} if quant is None else dict(gate_up=Scaling.of(d, quant.gate_up_block, gate.dtype),
                                            down=Scaling.of(f, quant.down_block, down.dtype))
    c = _PairConfig(block_f=bf, block_d=bd, splits=splits, chunk_d=chunk, block_n=bn, block_k=bk,
                    num_warps=num_warps or 4, num_stages=num_stages or 3, **scaling)
    gu_scales, d_scales = ((), ()) if quant is None else (
        (quant.gate.astype(jnp.float32), quant.up.astype(jnp.float32)), (quant.down.astype(jnp.float32),))
    flat = idx.reshape(p).astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages)
    partial = jax.ShapeDtypeStruct((c.splits, p, f), jnp.float32)
    pg, pu = pl.pallas_call(
        functools.partial(_pair_gate_up_kernel, c=c, d=d, f=f, k=k), out_shape=[partial, partial],
        grid=(p, cdiv(f, c.block_f), c.splits), compiler_params=params, interpret=interpret,
        name="dflash_moe_pair_gate_up")(flat, x, gate, up, *gu_scales)
    ys = pl.pallas_call(
        functools.partial(_pair_down_kernel, c=c, d=d, f=f, act=act),
        out_shape=jax.ShapeDtypeStruct((p, d), x.dtype), grid=(p, cdiv(d, c.block_n)),
        compiler_params=params, interpret=interpret, name="dflash_moe_pair_down")(
        flat, pg, pu, down, *d_scales, *(biases or ()))
    return combine(ys.reshape(n, k, d), weights)


def unsupported_reason(x, weights, idx, gate, up, down, *, biases: Biases | None = None,
                       quant: ExpertScales | None = None, interpret: bool = False, block_f: int | None = None,
                       block_d: int | None = None, block_n: int | None = None, block_k: int | None = None,
                       **_: object) -> str | None:
    """Why :func:`grouped_experts` cannot run these arguments here (None when it can). Arrays or
    ShapeDtypeStructs; ``quant``: the scales of quantized experts (their shapes, the values' dtype, tiles
    inside the scale blocks, float8 on sm_89 or newer: :func:`dflash_jax.cuda.quantized.weight_reason`)."""
    if not interpret and jax.default_backend() != "gpu":
        return f"needs a GPU backend (have {jax.default_backend()!r}; interpret=True runs on any backend)"
    if quant is None:
        return argument_reason(x, weights, idx, gate, up, down, biases, SUPPORTED_DTYPES)
    as_x = lambda a: jax.ShapeDtypeStruct(a.shape, x.dtype)  # noqa: E731 — the shape rules of float experts
    why = argument_reason(x, weights, idx, as_x(gate), as_x(up), as_x(down), biases, SUPPORTED_DTYPES)
    if why is not None:
        return why
    if not jnp.dtype(gate.dtype) == jnp.dtype(up.dtype) == jnp.dtype(down.dtype):
        return "gate, up and down values' dtypes differ"
    e, d, f = gate.shape
    for name, scale, (rows, cols), block in (("gate", quant.gate, (d, f), quant.gate_up_block),
                                             ("up", quant.up, (d, f), quant.gate_up_block),
                                             ("down", quant.down, (f, d), quant.down_block)):
        want = (e, cdiv(rows, block[0]), cdiv(cols, block[1]))
        if tuple(scale.shape) != want:
            return f"{name} scales {tuple(scale.shape)} do not fit [{rows}, {cols}] values in blocks of {block}"
    tiles = _pair_tiles if _pair_form(idx, e) else _sorted_tiles  # the form grouped_experts runs
    bf, bd, bn, bk = tiles(d, f, quant, block_f, block_d, block_n, block_k)
    return (weight_reason(gate.dtype, quant.gate_up_block, bd, bf, interpret=interpret)
            or weight_reason(down.dtype, quant.down_block, bk, bn, interpret=interpret))


def grouped_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                    down: jax.Array, *, biases: Biases | None = None, act: Callable = swiglu,
                    quant: ExpertScales | None = None, **tuning) -> jax.Array:
    """The routed experts' MLP of :func:`dflash_jax.kernels.moe.experts_gathered`, reading only routed experts'
    weights: :func:`pair_experts` for calls of at most :data:`PAIR_MAX_TOKENS` tokens and for quantized experts
    (``quant``; module docstring) of at most E pairs, else :func:`sorted_experts` (the pairs grouped by expert). Not
    jitted itself (``act`` may be a fresh closure each call): call it inside a jitted program. ``tuning``: the
    chosen function's keywords."""
    if quant is not None:  # pairs up to E: one program a pair (measured); more: each expert read once
        impl = pair_experts if _pair_form(idx, gate.shape[0]) else sorted_experts
        return impl(x, weights, idx, gate, up, down, biases=biases, act=act, quant=quant, **tuning)
    impl = pair_experts if idx.shape[0] <= PAIR_MAX_TOKENS else sorted_experts
    return impl(x, weights, idx, gate, up, down, biases=biases, act=act, **tuning)


def sorted_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, *, biases: Biases | None = None, act: Callable = swiglu,
                   quant: ExpertScales | None = None, block_f: int | None = None, block_d: int | None = None,
                   num_splits: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False,
                   programs_per_sm: int = 0) -> jax.Array:
    """The routed experts grouped by expert (module docstring): each routed expert's weights read once, however
    many tokens routed to it. Not jitted itself (``act`` may be a fresh closure each call): call it inside a
    jitted program. Tuning (static): ``block_f``/``block_d``/``num_splits`` of the gate/up kernel,
    ``block_n``/``block_k`` of the down kernel (powers of two ≥ 16; default 64, splits for ~4 programs per
    SM), ``num_warps`` (4), ``num_stages`` (3); ``programs_per_sm``: D splits of the gate/up kernel for
    about that many programs per SM when ``num_splits`` is None (0: none).

    ``quant``: quantized experts (module docstring): each tile loaded as stored, converted to x's dtype in
    registers for the tensor-core dot, the products scaled per loop step where the expert's input rows have
    several row blocks (tiles narrowed inside the scale blocks), else once."""
    n, k = idx.shape
    e, d, f = gate.shape
    p = n * k
    groups = min(e, p)
    c = _make_config(n, groups, d, f, x.dtype, block_f=block_f, block_d=block_d, num_splits=num_splits,
                     block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm, quant=quant, q_dtypes=(gate.dtype, down.dtype))
    gu_scales, d_scales = ((), ()) if quant is None else (
        (quant.gate.astype(jnp.float32), quant.up.astype(jnp.float32)), (quant.down.astype(jnp.float32),))
    grp = group_pairs(idx, e)
    xs = jnp.zeros((p, d), x.dtype).at[grp.pos].set(jnp.repeat(x, k, axis=0))  # pair rows in expert order
    meta = (grp.expert, grp.start, grp.count)
    params = plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages)
    partial = jax.ShapeDtypeStruct((c.splits, p, f), jnp.float32)
    pg, pu = pl.pallas_call(
        functools.partial(_gate_up_kernel, c=c, d=d, f=f), out_shape=[partial, partial],
        grid=(groups, cdiv(f, c.block_f), c.splits), compiler_params=params, interpret=interpret,
        name="dflash_moe_gate_up")(*meta, xs, gate, up, *gu_scales)
    ys = pl.pallas_call(
        functools.partial(_down_kernel, c=c, d=d, f=f, act=act, has_bias=biases is not None),
        out_shape=jax.ShapeDtypeStruct((p, d), x.dtype), grid=(groups, cdiv(d, c.block_n)),
        compiler_params=params, interpret=interpret, name="dflash_moe_down")(
        *meta, pg, pu, down, *d_scales, *(biases or ()))
    return combine(ys[grp.pos].reshape(n, k, d), weights)


def experts_kernel(x, weights, idx, gate, up, down, *, biases: Biases | None = None, act: Callable = swiglu,
                   kernels: Kernels, quant: ExpertScales | None = None) -> jax.Array | None:
    """The entry of the kernel dispatch (op ``"moe_experts"``): :func:`grouped_experts` (interpret mode off a GPU),
    per device under a mesh, or None where the XLA paths must run (float32 on a GPU: the kernel is measured in
    bfloat16 only; shapes it does not take; quantized experts where :func:`_quantized_entry` says no)."""
    interpret = not native("cuda")
    if not interpret and jnp.dtype(x.dtype) == jnp.float32:
        return None
    if quant is not None:
        return _quantized_entry(x, weights, idx, gate, up, down, biases=biases, act=act, kernels=kernels,
                                quant=quant, interpret=interpret)
    grouped = functools.partial(grouped_experts, interpret=interpret, programs_per_sm=kernels.tuning.programs_per_sm)
    return run_grouped("cuda", grouped, functools.partial(unsupported_reason, interpret=interpret), x, weights, idx,
                       gate, up, down, biases=biases, act=act)


def _quantized_entry(x, weights, idx, gate, up, down, *, biases, act, kernels: Kernels, quant: ExpertScales,
                     interpret: bool) -> jax.Array | None:
    """Quantized experts through :func:`pair_experts`, or None (the XLA references) where

    * the quantized-kernel knobs say no: ``kernels.tuning.quant_kernel`` off, or float8 values with
      ``quant_kernel_float8`` off (the knobs of :mod:`dflash_jax.cuda.quantized`, one switch for both kernels);
    * the call has more (token, expert) pairs than there are experts and ``moe_quantized_sorted`` is off:
      :func:`dflash_jax.kernels.moe.experts_auto` then runs every expert once (``experts_dense_quantized``, a
      few experts a loop step: E / K times the routed arithmetic). On, :func:`sorted_experts` reads each routed
      expert once for all its pairs (off until timed on a GPU);
    * under a device mesh (the scales' sharding over the experts' hidden is not split here);
    * :func:`unsupported_reason` names a reason."""
    tuning = kernels.tuning
    if not tuning.quant_kernel or (jnp.dtype(gate.dtype) == jnp.float8_e4m3fn and not tuning.quant_kernel_float8):
        return None  # turned off by the caller: not worth a log line
    if not _pair_form(idx, gate.shape[0]) and not tuning.moe_quantized_sorted:
        return None  # prefill-sized: the reference (docstring), not worth a log line either
    why = "under a device mesh" if mesh_sizes() else unsupported_reason(
        x, weights, idx, gate, up, down, biases=biases, quant=quant, interpret=interpret)
    if why is not None:
        log_once(f"MoE experts: quantized experts take the XLA path ({why})")
        return None
    return grouped_experts(x, weights, idx, gate, up, down, biases=biases, act=act, quant=quant, interpret=interpret,
                           programs_per_sm=tuning.programs_per_sm)
