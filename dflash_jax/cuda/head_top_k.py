"""The LM head and the top-K of its logits in one GPU kernel (Pallas → Triton; op ``"head_top_k"``,
:mod:`dflash_jax.kernels.top_k`): a DFlash2 drafter's K candidates at each block position, without writing the
``[N, V]`` float32 logits out and reading them back.

Why: at batch 1 a DFlash2 cycle's extra cost over DFlash's is mostly this top-K (``bench_top_k.py``,
benchmarks/README.md): XLA writes the logits (9.7 MB at 16 rows of Qwen3's 151,936 words), and its TopK then scans
each whole row with little parallelism. Here every program multiplies the rows by one tile of the head's columns
and keeps only that tile's K best per row; a ``lax.top_k`` over those candidates (K per tile: 19k a row for
Qwen3) finishes in XLA.

Layout: grid ``(N / rows, V / block_v)``; program (r, j) owns vocabulary columns ``[j · block_v, (j + 1) ·
block_v)`` of row tile r (``rows`` = N rounded up to a power of two in [16, 64]: ``tl.dot`` takes 16 rows at
least; the head is read once per row tile, so once up to 64 rows). It steps over D
``block_d`` rows at a time into a float32 ``[rows, block_v]`` accumulator (``h`` tile ``[rows, block_d]``, weight
tile ``[block_d, block_v]``, or ``[block_v, block_d]`` for a vocabulary-major head, a tied embedding), then takes
the tile's K best per row by K rounds of (max, its lowest column, mask it out). It writes ``[V / block_v, N',
K]`` values and column ids (N' = N rounded up to whole row tiles).

Exactness, given the logits the kernel forms: an entry among a row's K best (values descending, ties by the lowest
column) is among its tile's K best, and the candidates are laid out tile by tile, each tile's best first, so the
second stage's ties (lowest position first) are the row's (as :mod:`dflash_jax.cuda.top_k`'s argument). Two
departures from ``lax.top_k`` on the same numbers: +0 and −0 compare equal (the lower column first), and a
ragged last tile's missing columns are −inf with column ids ≥ V, which a row picks only where fewer than K of its
logits are above −inf. The logits themselves come from this kernel's float32 accumulation, not XLA's GEMM: a
near-tie may order differently from the unfused op, so drafting with it is exact as drafting (the target
verifies every draft) but not bit-identical to the reference's candidates.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.cuda.common import SUPPORTED_DTYPES, cdiv, highest_precision_requested, next_pow2
from dflash_jax.kernels.common import log_once, mesh_sizes, native

__all__ = ["head_top_k", "head_top_k_kernel"]

_MIN_ROWS = 16  # tl.dot's smallest M
MAX_TILE_ROWS = 64  # rows a program multiplies at once (past them the head is read again, once per row tile)


@dataclasses.dataclass(frozen=True)
class _Config:
    rows: int  # row tile (power of two in [16, 64])
    n: int  # real rows (over every row tile)
    d: int
    v: int
    k: int
    block_v: int
    block_d: int
    vocab_major: bool  # the weight is [V, D] (a tied embedding), else [D, V]
    ieee_f32: bool


def _kernel(h_ref, w_ref, val_ref, idx_ref, *, c: _Config):
    r, j = pl.program_id(0), pl.program_id(1)
    r0, v0 = r * c.rows, j * c.block_v
    cols = v0 + jnp.arange(c.block_v, dtype=jnp.int32)
    vmask = None if c.v % c.block_v == 0 else cols < c.v
    rmask = None if c.n % c.rows == 0 else r0 + jnp.arange(c.rows) < c.n
    prec = lax.Precision.HIGHEST if c.ieee_f32 else lax.Precision.DEFAULT

    def step(i, acc):
        d0 = i * c.block_d
        dmask = None if c.d % c.block_d == 0 else d0 + jnp.arange(c.block_d) < c.d
        hmask = _and(None if rmask is None else rmask[:, None], None if dmask is None else dmask[None, :])
        x = _load(h_ref.at[pl.ds(r0, c.rows), pl.ds(d0, c.block_d)], hmask)
        if c.vocab_major:  # [block_v, block_d] tile: contract both on D
            wmask = _and(None if vmask is None else vmask[:, None], None if dmask is None else dmask[None, :])
            w = _load(w_ref.at[pl.ds(v0, c.block_v), pl.ds(d0, c.block_d)], wmask)
            dims = (((1,), (1,)), ((), ()))
        else:
            wmask = _and(None if dmask is None else dmask[:, None], None if vmask is None else vmask[None, :])
            w = _load(w_ref.at[pl.ds(d0, c.block_d), pl.ds(v0, c.block_v)], wmask)
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(x, w.astype(x.dtype), dims, precision=prec,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, cdiv(c.d, c.block_d), step, jnp.zeros((c.rows, c.block_v), jnp.float32))
    if vmask is not None:
        acc = jnp.where(vmask[None, :], acc, -jnp.inf)
    slots = jnp.arange(c.k, dtype=jnp.int32)
    vals = jnp.full((c.rows, c.k), -jnp.inf, jnp.float32)
    ids = jnp.zeros((c.rows, c.k), jnp.int32)
    for t in range(c.k):  # K rounds: the best left, its lowest column, then out of the running
        best = jnp.max(acc, axis=1)
        at = jnp.min(jnp.where(acc == best[:, None], cols[None, :], jnp.int32(2**31 - 1)), axis=1)
        vals = jnp.where(slots[None, :] == t, best[:, None], vals)
        ids = jnp.where(slots[None, :] == t, at[:, None], ids)
        acc = jnp.where(cols[None, :] == at[:, None], -jnp.inf, acc)
    plgpu.store(val_ref.at[j, pl.ds(r0, c.rows)], vals)
    plgpu.store(idx_ref.at[j, pl.ds(r0, c.rows)], ids)


def _and(*masks):
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _load(ref, mask):
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def head_top_k(h: jax.Array, w: jax.Array, k: int, *, vocab_major: bool, block_v: int = 128, block_d: int = 64,
               num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(float32 values, int32 ids) of the ``k`` largest logits ``h @ w`` of each row (``w [D, V]``, or ``[V, D]``
    with ``vocab_major``), best first, ties by the lowest id (module docstring). ``h [*b, D]``; ``k ≤ block_v``."""
    *lead, d = h.shape
    v = w.shape[0] if vocab_major else w.shape[1]
    n = 1
    for s in lead:
        n *= s
    if not 1 <= k <= min(block_v, v) or (w.shape[1] if vocab_major else w.shape[0]) != d:
        raise ValueError(f"head_top_k: k = {k} (at most block_v {block_v} and V {v}), h {h.shape} against a head of "
                         f"{w.shape} (vocab_major={vocab_major})")
    rows = min(MAX_TILE_ROWS, max(_MIN_ROWS, next_pow2(n)))
    padded = cdiv(n, rows) * rows
    tiles = cdiv(v, block_v)
    c = _Config(rows=rows, n=n, d=d, v=v, k=k, block_v=block_v, block_d=block_d, vocab_major=vocab_major,
                ieee_f32=jnp.dtype(h.dtype) == jnp.float32 and highest_precision_requested())
    x = h.reshape(n, d)
    if n < padded:  # padded rows multiply zeros; their candidates are dropped below
        x = jnp.pad(x, ((0, padded - n), (0, 0)))
    vals, ids = pl.pallas_call(
        functools.partial(_kernel, c=c),
        out_shape=(jax.ShapeDtypeStruct((tiles, padded, k), jnp.float32),
                   jax.ShapeDtypeStruct((tiles, padded, k), jnp.int32)),
        grid=(padded // rows, tiles), compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="dflash_head_top_k")(x, w)
    # Stage 2: the K best of each row's candidates, laid out tile by tile (ties: the lowest position, i.e. id).
    vals = vals[:, :n].transpose(1, 0, 2).reshape(n, tiles * k)
    ids = ids[:, :n].transpose(1, 0, 2).reshape(n, tiles * k)
    best, at = lax.top_k(vals, k)
    return best.reshape(*lead, k), jnp.take_along_axis(ids, at, axis=-1).reshape(*lead, k)


def head_top_k_kernel(h, w, k, *, vocab_major: bool, kernels) -> tuple[jax.Array, jax.Array] | None:
    """The dispatch's entry: :func:`head_top_k` (interpret mode off a GPU), or None (the head, then the op
    ``"top_k"``) for more rows than ``kernels.tuning.head_top_k_max_rows`` (0: any), a ``k`` above the vocabulary
    tile, dtypes the kernel does not take, or under a device mesh (a sharded head)."""
    n = h.size // max(h.shape[-1], 1)
    v = w.shape[0] if vocab_major else w.shape[1]
    block_v = kernels.tuning.head_top_k_block_v
    most = kernels.tuning.head_top_k_max_rows
    if (most and n > most) or not 1 <= k <= min(block_v, v):
        return None
    if jnp.dtype(h.dtype) not in SUPPORTED_DTYPES or jnp.dtype(w.dtype) not in SUPPORTED_DTYPES:
        log_once(f"head_top_k: the head, then lax.top_k ({h.dtype} rows, {w.dtype} head)")
        return None
    if mesh_sizes():
        log_once("head_top_k: the head, then lax.top_k (under a device mesh)")
        return None
    return head_top_k(h, w, k, vocab_major=vocab_major, block_v=block_v, interpret=not native("cuda"))
