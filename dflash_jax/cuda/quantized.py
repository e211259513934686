"""GPU dequantize-and-multiply (Pallas → Triton): ``x @ W`` for a few tokens and an int8 / fp8 (e4m3) kernel
``W`` with float32 block scales, reading the quantized bytes and never writing a dequantized kernel.

Same semantics and arguments as :func:`dflash_jax.kernels.quantized.reference` (the jnp reference): ``x [T, D]``
(leading axes flattened), ``q [D, E]`` int8 or float8_e4m3fn, ``scale [ceil(D / bi), ceil(E / bo)]`` float32,
``block = (bi, bo)`` (layout in :mod:`dflash_jax.quant.scheme`). T is small: a decode step (1 token a row),
a verify block (16–64); prefill keeps the XLA path (compute-bound there, where a dequantized operand costs
little next to the products).

Why: a decode step is bound by the weights it reads. Whether XLA fuses the reference's int8 → bfloat16
conversion into its dot or writes the converted kernel out first is XLA's choice, backend by backend; this
kernel loads weight tiles as stored (1 byte a value), converts them in registers and accumulates in float32.
On GPUs XLA does fuse it (its Triton GEMM fusion reads the int8 bytes) and its one-token step was the faster
(benchmarks/README.md, "Quantized targets"), so GPUs run XLA's by default (``KernelTuning.quant_kernel_impls``);
the kernel stays for A/B runs, for XLA versions that do not fuse, and as the quantized grouped-expert kernel's
base.

Several kernels that share their input (a layer's q / k / v, an MLP's gate / up: :func:`quantized_matmuls`) run in
one launch: the grid's column axis runs over each kernel's column blocks in turn, and a program works on the
kernel its column block belongs to. At decode sizes a launch and its ramp cost about what a 4096 × 1024 int8
kernel's bytes do, so a Qwen3-8B layer's seven launches become four.

Layout: grid ``(row tiles, E / block_e, splits)``. Program (r, j, s) owns output columns ``[e0, e0 + block_e)``
of ``rows`` token rows and the D rows of its split; it steps over them ``block_d`` at a time (software-
pipelined ``num_stages`` deep): an ``x`` tile ``[rows, block_d]`` (x's dtype) and a weight tile ``[block_d,
block_e]`` (int8 / fp8, converted to x's dtype: exact, every int8 and e4m3 value is a bfloat16 number) are
multiplied into a float32 ``[rows, block_e]`` accumulator. Scales:

* one row block (per output channel, or blocks of output columns): applied once to the accumulator;
* several row blocks (group-wise int8, HF's 128 × 128 FP8 blocks): ``block_d`` divides ``bi``, so every step
  lies in one row block and its product is scaled before it is added (per column, or one scalar when
  ``block_e`` divides ``bo``).

``rows`` = clamp(next_pow2(T), 16, 64) for the tensor-core path (``tl.dot`` takes 16 rows at least; rows past T
load zeros and are never stored). One token (``gemv``, the default at T = 1) multiplies elementwise into a
``[block_d, block_e]`` float32 accumulator summed over D once at the end, as :func:`dflash_jax.cuda.moe.
pair_experts` does: no padding rows, no operand shuffle into the tensor-core layout.

D splits: few output blocks (a 4096 × 1024 K/V projection is 16 blocks of 64 columns) would leave most SMs
idle, so D is cut into ``splits`` so that about ``programs_per_sm`` programs run per SM; the splits' float32
partial sums ``[splits, T, E]`` are added by XLA (a few percent of the weight bytes at decode sizes). Defaults
(64 columns, 128 D rows a step, 4 warps, 4 stages, ~4 programs per SM) are reasoned, not swept:
``benchmarks/bench_quantized_step.py --sweep`` times alternatives on the GPU.

The tile fitting, float8 loads and scale application (:func:`fit_scale_blocks`, :func:`weight_reason`,
:class:`Scaling`) serve the quantized grouped-expert kernels of :mod:`dflash_jax.cuda.moe` too.

float8 tiles need ``sm_89`` or newer (Triton converts e4m3 in registers from Ada / Hopper on); int8 runs on any
GPU the other kernels run on. A float8 tile at a ragged edge of the kernel (D or E not a multiple of the tile) is
loaded with no fill value and its lanes outside the kernel are zeroed after the conversion: Pallas' Triton rules
cast a load's fill value to the pointee type and have no integer → float8 cast. Float32 activations follow JAX's
default matmul precision (TF32, or IEEE under "highest"), as in :mod:`dflash_jax.cuda`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.cuda.common import (SUPPORTED_DTYPES, cdiv, compute_capability, highest_precision_requested,
                                    next_pow2, num_sms)
from dflash_jax.kernels.common import log_once, mesh_sizes, native
from dflash_jax.tuning import Kernels

__all__ = ["quantized_matmul", "quantized_matmul_kernel", "quantized_matmuls", "quantized_projections_kernel",
           "unsupported_reason"]

WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_MIN_TILE = 16  # tl.dot's smallest M, N and K
_MIN_SPLIT_ROWS = 256  # a D split streams at least this many kernel rows


@dataclasses.dataclass(frozen=True)
class _Config:
    rows: int  # token rows per tile (power of two >= 16; 1 on the GEMV path)
    block_e: int  # output columns per program
    block_d: int  # kernel rows per loop step
    splits: int  # D splits (programs), summed after the kernel
    chunk_d: int  # kernel rows per split (a multiple of block_d)
    gemv: bool
    scaling: tuple[Scaling, ...]  # one per kernel of the call
    widths: tuple[int, ...]  # E of each kernel
    col_blocks: tuple[int, ...]  # programs along E of each kernel (cdiv(E, block_e)), in order along the grid
    num_warps: int
    num_stages: int
    ieee_f32: bool


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n`` and at most ``cap``."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def fit_scale_blocks(rows: int, block: tuple[int, int], block_rows: int, block_cols: int) -> tuple[int, int]:
    """(block_rows, block_cols) of a weight tile over a ``[rows, ·]`` kernel scaled in ``block = (bi, bo)``,
    narrowed so that each tile lies inside one scale block where the scales have several: ``block_cols``
    dividing bo > 1 (one scale per tile and row block), ``block_rows`` dividing bi < rows (each loop step in one
    row block). Either may fall below :data:`_MIN_TILE` (:func:`weight_reason` says so)."""
    bi, bo = block
    if bo > 1:
        block_cols = min(block_cols, _pow2_divisor(bo, block_cols))
    if cdiv(rows, bi) > 1:
        block_rows = min(block_rows, _pow2_divisor(bi, block_rows))
    return block_rows, block_cols


def _blocks(d: int, e: int, block: tuple[int, int], block_e: int | None, block_d: int | None) -> tuple[int, int]:
    """(block_e, block_d): powers of two ≥ 16, no wider than needed, each tile inside one scale block where the
    scales have several (:func:`fit_scale_blocks`)."""
    be = max(_MIN_TILE, min(next_pow2(block_e or 64), next_pow2(e)))
    bd = max(_MIN_TILE, min(next_pow2(block_d or 128), next_pow2(d)))
    bd, be = fit_scale_blocks(d, block, bd, be)
    return be, bd


def weight_reason(q_dtype, block: tuple[int, int], block_rows: int, block_cols: int, *,
                  interpret: bool) -> str | None:
    """Why a kernel cannot stream quantized values of ``q_dtype`` scaled in ``block`` through tiles of
    ``block_rows`` × ``block_cols`` (from :func:`fit_scale_blocks`) here, or None: the rules this module's kernel
    and the quantized grouped-expert kernels (:mod:`dflash_jax.cuda.moe`) share."""
    if jnp.dtype(q_dtype) not in WEIGHT_DTYPES:
        return f"kernel dtype {jnp.dtype(q_dtype)} is not int8 or float8_e4m3fn"
    if block_cols < _MIN_TILE:
        return f"scale blocks of {block[1]} columns have no power-of-two tile of ≥ {_MIN_TILE} columns inside them"
    if block_rows < _MIN_TILE:
        return f"scale blocks of {block[0]} rows have no power-of-two tile of ≥ {_MIN_TILE} rows inside them"
    cc = None if interpret else compute_capability()
    if jnp.dtype(q_dtype) == jnp.float8_e4m3fn and cc is not None and cc < (8, 9):
        return f"float8 tiles need sm_89 or newer (this GPU is sm_{cc[0]}{cc[1]})"
    return None


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How a kernel's quantized tiles and float32 block scales ``block = (bi, bo)`` meet (module docstring):
    static, part of a kernel's config. Tiles come from :func:`fit_scale_blocks`."""

    bi: int
    bo: int
    per_step: bool  # several row blocks: each step's product scaled before it is added
    scalar: bool  # bo > 1: one scale per (row block, program) instead of one per column
    float8: bool  # float8_e4m3fn values (masked tiles loaded without a fill value: module docstring)

    @classmethod
    def of(cls, rows: int, block: tuple[int, int], q_dtype) -> "Scaling":
        """The scaling of a ``[rows, ·]`` kernel of ``q_dtype`` values scaled in ``block``."""
        bi, bo = block
        return cls(bi=bi, bo=bo, per_step=cdiv(rows, bi) > 1, scalar=bo > 1,
                   float8=jnp.dtype(q_dtype) == jnp.float8_e4m3fn)

    def weights(self, tile_ref, mask, dtype) -> jax.Array:
        """The weight tile ``tile_ref`` converted to ``dtype`` (exact), zeros where ``mask`` is False."""
        if self.float8 and mask is not None:  # no float8 fill value (module docstring): zeroed once converted
            return jnp.where(mask, plgpu.load(tile_ref, mask=mask).astype(dtype), 0)
        return _load(tile_ref, mask).astype(dtype)

    def scaled(self, part: jax.Array, s_ref, lead: tuple, kb, c0, width: int, cmask) -> jax.Array:
        """``part`` (``[..., width]`` float32 products of columns ``[c0, c0 + width)``) times row block ``kb``'s
        scales of those columns, read from ``s_ref[*lead, kb, :]``: a scalar, or one per column."""
        if self.scalar:
            return part * s_ref[(*lead, kb, c0 // self.bo)]
        s = _load(s_ref.at[(*lead, kb, pl.ds(c0, width))], cmask)
        return part * (s if part.ndim == 1 else s[None, :])


def unsupported_reason(x, q, scale, block: tuple[int, int], *, interpret: bool = False, block_e: int | None = None,
                       block_d: int | None = None, **_: object) -> str | None:
    """Why :func:`quantized_matmul` cannot run these arguments (arrays or ShapeDtypeStructs) here, or None."""
    if not interpret and jax.default_backend() != "gpu":
        return f"needs a GPU backend (have {jax.default_backend()!r}; interpret=True runs on any backend)"
    if q.ndim != 2 or x.shape[-1] != q.shape[0]:
        return f"expected x [..., D] and a kernel [D, E], got {tuple(x.shape)} and {tuple(q.shape)}"
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        return f"activations {jnp.dtype(x.dtype)} are not one of {', '.join(map(str, SUPPORTED_DTYPES))}"
    d, e = q.shape
    be, bd = _blocks(d, e, block, block_e, block_d)
    return weight_reason(q.dtype, block, bd, be, interpret=interpret)


def _make_config(t: int, d: int, widths: tuple[int, ...], blocks: tuple[tuple[int, int], ...], dtype, q_dtype, *,
                 block_e, block_d, num_splits, gemv, num_warps, num_stages, programs_per_sm: int) -> _Config:
    # One tile shape for every kernel of the call: powers of two, so the narrowest fits inside every kernel's
    # scale blocks.
    be, bd = (min(v) for v in zip(*(_blocks(d, e, b, block_e, block_d) for e, b in zip(widths, blocks))))
    gemv = t == 1 if gemv is None else bool(gemv and t == 1)
    rows = 1 if gemv else min(max(next_pow2(t), _MIN_TILE), 64)
    col_blocks = tuple(cdiv(e, be) for e in widths)
    programs = cdiv(t, rows) * sum(col_blocks)
    if num_splits is None:
        num_splits = max(1, min(cdiv((programs_per_sm or 4) * num_sms(), programs), d // _MIN_SPLIT_ROWS))
    num_splits = max(1, min(num_splits, cdiv(d, bd)))
    chunk = cdiv(cdiv(d, num_splits), bd) * bd
    return _Config(rows=rows, block_e=be, block_d=bd, splits=cdiv(d, chunk), chunk_d=chunk, gemv=gemv,
                   scaling=tuple(Scaling.of(d, b, q_dtype) for b in blocks), widths=tuple(widths),
                   col_blocks=col_blocks, num_warps=num_warps or 4, num_stages=num_stages or 4,
                   ieee_f32=jnp.dtype(dtype) == jnp.float32 and highest_precision_requested())


def _tail_mask(start, block: int, extent: int):
    """[block] mask of indices < extent, or None when blocks tile the extent exactly."""
    return None if extent % block == 0 else start + jnp.arange(block) < extent


def _and(*masks):
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _load(ref, mask):
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _kernel(x_ref, *refs, c: _Config, t: int, d: int):
    # x [T, D]; then per kernel m of the call: q_m [D, E_m] int8 / fp8, s_m [nbi, nbo] float32, o_m [splits, T,
    # E_m] float32 (or [T, E_m] when one split). The programs along the grid's E axis take the kernels in turn.
    n = len(c.widths)
    q_refs, s_refs, o_refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    # (program ids are read here: Pallas' interpret mode has none inside a branch)
    r, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if n == 1:
        _program(x_ref, q_refs[0], s_refs[0], o_refs[0], r, j, sp, c=c, m=0, t=t, d=d)
        return
    first = 0
    for m in range(n):
        last = first + c.col_blocks[m]

        @pl.when((j >= first) & (j < last))
        def _(m=m, first=first):
            _program(x_ref, q_refs[m], s_refs[m], o_refs[m], r, j - first, sp, c=c, m=m, t=t, d=d)
        first = last


def _program(x_ref, q_ref, s_ref, o_ref, r, j, sp, *, c: _Config, m: int, t: int, d: int):
    """Program (r, ·, sp)'s work on kernel ``m``: its ``j``-th block of output columns (module docstring)."""
    e = c.widths[m]
    r0, e0, d_lo = r * c.rows, j * c.block_e, sp * c.chunk_d
    rmask = _tail_mask(r0, c.rows, t) if not c.gemv else None
    emask = _tail_mask(e0, c.block_e, e)
    steps = lax.div(jnp.minimum(c.chunk_d, d - d_lo) + c.block_d - 1, c.block_d)
    compute, q = x_ref.dtype, c.scaling[m]

    def scaled(part, kb):
        return q.scaled(part, s_ref, (), kb, e0, c.block_e, emask)

    def weights(d0, dmask, dtype):
        """The weight tile [block_d, block_e] in ``dtype``, zeros outside the kernel."""
        wmask = _and(None if dmask is None else dmask[:, None], None if emask is None else emask[None, :])
        return q.weights(q_ref.at[pl.ds(d0, c.block_d), pl.ds(e0, c.block_e)], wmask, dtype)

    def step(i, acc):
        d0 = d_lo + i * c.block_d
        dmask = _tail_mask(d0, c.block_d, d)
        if c.gemv:  # one token: multiply-adds into [block_d, block_e], summed over D after the loop
            xv = _load(x_ref.at[jnp.int32(0), pl.ds(d0, c.block_d)], dmask).astype(jnp.float32)
            part = xv[:, None] * weights(d0, dmask, jnp.float32)
        else:
            xt = _load(x_ref.at[pl.ds(r0, c.rows), pl.ds(d0, c.block_d)],
                       _and(None if rmask is None else rmask[:, None], None if dmask is None else dmask[None, :]))
            prec = lax.Precision.HIGHEST if c.ieee_f32 else lax.Precision.DEFAULT
            part = lax.dot_general(xt, weights(d0, dmask, compute), (((1,), (0,)), ((), ())),
                                   precision=prec, preferred_element_type=jnp.float32)
        if q.per_step:
            part = scaled(part, d0 // q.bi)
        return acc + part

    shape = (c.block_d, c.block_e) if c.gemv else (c.rows, c.block_e)
    acc = lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
    if c.gemv:
        acc = jnp.sum(acc, axis=0)[None, :]
    if not q.per_step:
        acc = scaled(acc, jnp.int32(0))
    omask = _and(None if rmask is None else rmask[:, None], None if emask is None else emask[None, :])
    rows = pl.ds(r0, c.rows) if not c.gemv else pl.ds(0, 1)
    out = o_ref.at[sp, rows, pl.ds(e0, c.block_e)] if c.splits > 1 else o_ref.at[rows, pl.ds(e0, c.block_e)]
    plgpu.store(out, acc.astype(o_ref.dtype), mask=omask)


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, block: tuple[int, int], *, out_dtype=None,
                     **tuning) -> jax.Array:
    """``x @ dequantize(q, scale)`` (module docstring) in ``out_dtype`` (x's dtype unless given); ``tuning``:
    :func:`quantized_matmuls`'."""
    return quantized_matmuls(x, (q,), (scale,), (block,), out_dtype=out_dtype, **tuning)[0]


def quantized_matmuls(x: jax.Array, qs: tuple[jax.Array, ...], scales: tuple[jax.Array, ...],
                      blocks: tuple[tuple[int, int], ...], *, out_dtype=None, block_e: int | None = None,
                      block_d: int | None = None, num_splits: int | None = None, gemv: bool | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, programs_per_sm: int = 0,
                      interpret: bool = False) -> tuple[jax.Array, ...]:
    """``x @ dequantize(q_m, scale_m)`` for each kernel m (``[D, E_m]``, one weight dtype) in one launch — a
    layer's q / k / v or an MLP's gate / up share their input, and at decode sizes a launch and its ramp cost
    about what a 4096 × 1024 int8 kernel's bytes do. Tuning (static, shared by the kernels): ``block_e`` output
    columns per program (64), ``block_d`` kernel rows per step (128; both powers of two ≥ 16, narrowed to fit
    inside every kernel's scale blocks), ``num_splits`` D splits (default: ~``programs_per_sm`` (4) programs per
    SM), ``gemv`` the one-token path (default: at T = 1), ``num_warps`` (4), ``num_stages`` (4)."""
    d = x.shape[-1]
    lead, widths = x.shape[:-1], tuple(q.shape[1] for q in qs)
    if any(q.shape[0] != d for q in qs) or len({jnp.dtype(q.dtype) for q in qs}) != 1:
        raise ValueError(f"quantized_matmuls: kernels {[q.shape for q in qs]} of dtypes "
                         f"{sorted({str(q.dtype) for q in qs})} do not share x's {d} input rows and one dtype")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x2 = x.reshape(-1, d)
    t = x2.shape[0]
    c = _make_config(t, d, widths, tuple(map(tuple, blocks)), x.dtype, qs[0].dtype, block_e=block_e, block_d=block_d,
                     num_splits=num_splits, gemv=gemv, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm)
    rows = 1 if c.gemv else c.rows
    # One split writes the outputs directly; several write float32 partial sums that XLA adds.
    out_shape = tuple(jax.ShapeDtypeStruct((c.splits, t, e), jnp.float32) if c.splits > 1
                      else jax.ShapeDtypeStruct((t, e), out_dtype) for e in widths)
    outs = pl.pallas_call(
        functools.partial(_kernel, c=c, t=t, d=d), out_shape=out_shape,
        grid=(cdiv(t, rows), sum(c.col_blocks), c.splits),
        compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
        interpret=interpret, name="dflash_quantized_matmul")(x2, *qs, *(s.astype(jnp.float32) for s in scales))
    if c.splits > 1:
        outs = tuple(jnp.sum(o, axis=0) for o in outs)
    return tuple(o.astype(out_dtype).reshape(*lead, e) for o, e in zip(outs, widths))


def _refusal(x, q, scale, block, kernels: Kernels, interpret: bool) -> str | None:
    """Why the dispatch's entries run the reference for this kernel: "" where not worth a log line (not among
    ``kernels.tuning.quant_kernel_impls``, more tokens than ``quant_kernel_max_tokens`` — unless a kernel of
    several row blocks within ``quant_kernel_blocked_min_tokens`` … ``_max_tokens`` — float8 weights with
    ``quant_kernel_float8`` off), a reason
    (shapes the kernel does not take, or under a mesh: the op does not know how its kernel is split, and a custom
    call over sharded operands would gather them), or None."""
    t = 1
    for n in x.shape[:-1]:
        t *= n
    tuning = kernels.tuning
    if scale.shape[0] > 1 and tuning.quant_kernel_blocked_min_tokens <= t <= tuning.quant_kernel_blocked_max_tokens:
        pass  # several row blocks: XLA has no fused form (KernelTuning.quant_kernel_blocked_max_tokens)
    elif "cuda" not in tuning.quant_kernel_impls:
        return ""  # XLA's own fused conversion and GEMM (KernelTuning.quant_kernel_impls)
    elif t > tuning.quant_kernel_max_tokens:
        return ""  # prefill: the XLA path
    if jnp.dtype(q.dtype) == jnp.float8_e4m3fn and not tuning.quant_kernel_float8:
        return ""  # turned off by the caller
    return "under a device mesh" if mesh_sizes() else unsupported_reason(x, q, scale, block, interpret=interpret)


def quantized_matmul_kernel(x, q, scale, block, *, out_dtype, kernels: Kernels) -> jax.Array | None:
    """The entry of the kernel dispatch (op ``"quantized_matmul"``): :func:`quantized_matmul` (interpret mode off
    a GPU), or None where the reference must run (:func:`_refusal`)."""
    interpret = not native("cuda")
    why = _refusal(x, q, scale, block, kernels, interpret)
    if why is not None:
        if why:
            log_once(f"quantized matmul: the XLA reference instead of the GPU kernel ({why})")
        return None
    return quantized_matmul(x, q, scale, block, out_dtype=out_dtype, interpret=interpret,
                            programs_per_sm=kernels.tuning.programs_per_sm)


def quantized_projections_kernel(x, weights, *, out_dtype, kernels: Kernels) -> tuple[jax.Array, ...] | None:
    """The entry of the kernel dispatch (op ``"quantized_projections"``): :func:`quantized_matmuls` over every
    ``(q, scale, block)`` of ``weights`` in one launch, or None (each kernel then goes through the op
    ``"quantized_matmul"``) where the quantized kernel is off, a kernel would be refused alone
    (:func:`_refusal`) or the kernels' weight dtypes differ."""
    if not kernels.tuning.quant_kernel or len({jnp.dtype(q.dtype) for q, _, _ in weights}) != 1:
        return None
    interpret = not native("cuda")
    if any(_refusal(x, q, s, b, kernels, interpret) is not None for q, s, b in weights):
        return None  # each kernel alone logs its own reason
    qs, scales, blocks = zip(*weights)
    return quantized_matmuls(x, qs, scales, blocks, out_dtype=out_dtype, interpret=interpret,
                             programs_per_sm=kernels.tuning.programs_per_sm)
