"""TPU (Mosaic) dequantize-and-multiply: ``x @ W`` for a few tokens and an int8 / fp8 (e4m3) kernel ``W`` with
float32 block scales, reading the quantized bytes and never writing a dequantized kernel.

Same semantics and arguments as :func:`dflash_jax.kernels.quantized.reference` (the jnp reference) and the GPU
kernel :mod:`dflash_jax.cuda.quantized`: ``x [T, D]`` (leading axes flattened), ``q [D, E]`` int8 or
float8_e4m3fn, ``scale [ceil(D / bi), ceil(E / bo)]`` float32, ``block = (bi, bo)`` (layout in
:mod:`dflash_jax.quant.scheme`). T is small (a decode step, a verify block); prefill keeps the XLA path.

Why: a decode step is bound by the weights it reads; whether XLA fuses the reference's conversion into its dot
or writes the converted kernel out first is its choice. Here weight tiles are DMA'd into VMEM as stored (1 byte
a value), converted to the activations' dtype inside the kernel (vector registers and VMEM, never HBM; exact:
every int8 and e4m3 value is a bfloat16 number, so TPUs without float8 MXUs multiply the converted tile) and
multiplied on the MXU into float32.

Layout: grid ``(E / be, D / bd)``, ("parallel", "arbitrary"): D, the reduction, is the last (sequential) axis.
Step (j, k) gets the activations ``[Tp, bd]`` (T padded up to the dtype's sublane tile with zero rows, cut off
after), the weight tile ``[bd, be]`` and its scales, and adds its float32 product to a ``[Tp, be]`` VMEM
accumulator zeroed at k = 0; the last k writes the output tile. Scales:

* one row block (per output channel, or blocks of output columns): applied once, at the last step;
* several row blocks (group-wise int8, HF's 128 × 128 FP8 blocks): a step spans ``r = bd / bi`` whole row
  blocks (or lies inside one when ``bd`` divides ``bi``); each row block's product is scaled before it is added.

Scales reach the kernel as ``scale.reshape(nbi, E / be, 1, nc)`` — a free reshape, ``nc`` = be scales per tile
row (bo = 1) or ``be / bo`` (column blocks, expanded to per-column scales in the kernel) — so that every block's
last two dims are whole dims (Mosaic's block rule).

Shapes taken: D and E multiples of 128 (tiles divide them: a ragged kernel would need its padded copy at every
call), ``bi`` a multiple of 128 when there are several row blocks, and a tile of whole column blocks when bo > 1.
Tiles: ``be`` the largest multiple of lcm(128, bo) dividing E, at most 1024 and at most E / 2 where E allows
(two column tiles for the two TensorCores of "parallel" chips); ``bd`` the largest multiple of 128 dividing D
(a multiple or divisor of bi) with a weight tile of at most 1 MiB. Reasoned, not swept; ``block_e`` /
``block_d`` override them.

Untested on real TPUs (none available to us): tested in TPU interpret mode and lowered to Mosaic for platform
"tpu" on CPU; performance, VMEM sizing and Mosaic's support of the in-register int8 / float8 → bfloat16
conversion on each TPU generation unverified. On a TPU the entry therefore compiles each shape alone first and
falls back to the reference if Mosaic refuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dflash_jax.kernels.common import compile_probe, highest_precision_requested, log_once, mesh_sizes, native
from dflash_jax.pallas.common import LANES, Interpret, interpret_arg, round_up, sublanes
from dflash_jax.tuning import Kernels

__all__ = ["quantized_matmul", "quantized_matmul_kernel", "unsupported_reason"]

WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_BLOCK_E = 1024  # default cap on output columns per tile
_WEIGHT_TILE_BYTES = 1 << 20  # default cap on one weight tile (the pipeline double-buffers it)
_VMEM_HARD_LIMIT = 48 * 2**20


@dataclasses.dataclass(frozen=True)
class _Tiles:
    be: int  # output columns per tile
    bd: int  # kernel rows per step
    sub: int  # kernel rows per scaled product: min(bd, bi) with several row blocks, else bd
    r: int  # row blocks per step (bd // sub)
    nc: int  # scales per tile row: be (bo = 1) or be // bo
    per_step: bool  # several row blocks: each row block's product scaled before it is added
    bo: int


def _tiles(d: int, e: int, block: tuple[int, int], block_e: int | None = None,
           block_d: int | None = None) -> _Tiles | str:
    """The tiles for a ``[d, e]`` kernel with scale ``block``, or why there are none (module docstring)."""
    bi, bo = block
    if d % LANES or e % LANES:
        return f"kernel [{d}, {e}] is not a multiple of {LANES} in both dims (a ragged kernel would be padded per call)"
    unit_e = LANES if bo == 1 else math.lcm(LANES, bo)
    fits_e = [b for b in range(unit_e, e + 1, unit_e) if e % b == 0]
    if not fits_e:
        return f"no tile of whole {bo}-column scale blocks (a multiple of {unit_e}) divides E={e}"
    if block_e is not None:
        if block_e not in fits_e:
            return f"block_e={block_e} must divide E={e} and be a multiple of {unit_e}"
        be = block_e
    else:
        cap = min(_BLOCK_E, max(unit_e, e // 2))
        be = max([b for b in fits_e if b <= cap], default=fits_e[0])
    several = -(-d // bi) > 1
    if several and bi % LANES:
        return f"several scale blocks of {bi} rows: {bi} is not a multiple of {LANES}"
    fits_d = [b for b in range(LANES, d + 1, LANES) if d % b == 0 and (not several or b % bi == 0 or bi % b == 0)]
    if block_d is not None:
        if block_d not in fits_d:
            return (f"block_d={block_d} must divide D={d}, be a multiple of {LANES}"
                    + (f" and a multiple or divisor of bi={bi}" if several else ""))
        bd = block_d
    else:
        cap = max(LANES, _WEIGHT_TILE_BYTES // be)
        bd = max([b for b in fits_d if b <= cap], default=fits_d[0])
    sub = min(bd, bi) if several else bd
    return _Tiles(be=be, bd=bd, sub=sub, r=bd // sub, nc=be if bo == 1 else be // bo, per_step=several, bo=bo)


def _vmem_bytes(tp: int, t: _Tiles, x_dtype, out_dtype) -> int:
    """Estimated VMEM of one kernel: double-buffered blocks, the accumulator and the converted weight tile."""
    xs, os_ = jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    blocks = t.bd * t.be + tp * t.bd * xs + t.r * 8 * round_up(t.nc, LANES) * 4 + tp * t.be * os_
    temps = t.bd * t.be * (xs + 4) + 2 * round_up(tp, 8) * t.be * 4  # converted tile (via float32), products
    return 2 * blocks + round_up(tp, 8) * t.be * 4 + temps


def unsupported_reason(x, q, scale, block: tuple[int, int], *, out_dtype=None, interpret: Interpret = None,
                       block_e: int | None = None, block_d: int | None = None, vmem_limit_bytes: int | None = None,
                       **_: object) -> str | None:
    """Why :func:`quantized_matmul` cannot run these arguments (arrays or ShapeDtypeStructs) as a Mosaic kernel
    here, or None. Mosaic may still refuse a shape (the entry compiles it first on a TPU)."""
    if q.ndim != 2 or x.shape[-1] != q.shape[0]:
        return f"expected x [..., D] and a kernel [D, E], got {tuple(x.shape)} and {tuple(q.shape)}"
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
        return f"activations {jnp.dtype(x.dtype)} are not one of {', '.join(map(str, _SUPPORTED_DTYPES))}"
    if jnp.dtype(q.dtype) not in WEIGHT_DTYPES:
        return f"kernel dtype {jnp.dtype(q.dtype)} is not int8 or float8_e4m3fn"
    d, e = q.shape
    if tuple(scale.shape) != (-(-d // block[0]), -(-e // block[1])):
        return f"scale {tuple(scale.shape)} does not fit kernel {tuple(q.shape)} in blocks of {tuple(block)}"
    tiles = _tiles(d, e, tuple(block), block_e, block_d)
    if isinstance(tiles, str):
        return tiles
    if interpret_arg(interpret):
        return None
    t = math.prod(x.shape[:-1])
    need = _vmem_bytes(round_up(t, sublanes(x.dtype)), tiles, x.dtype, out_dtype or x.dtype)
    limit = vmem_limit_bytes or _VMEM_HARD_LIMIT
    if need > limit:
        return f"estimated VMEM {need / 2**20:.1f} MiB > {limit / 2**20:.0f} MiB (lower block_e / block_d)"
    if jax.default_backend() != "tpu":
        return f"Mosaic kernels need a TPU backend (have {jax.default_backend()!r}; pass interpret=...)"
    return None


def _column_scales(s: jax.Array, t: _Tiles) -> jax.Array:
    """A tile's scales ``[1, nc]`` as a per-column ``[1, be]`` (or ``[1, 1]``) factor. Column blocks (bo > 1):
    scale c covers columns [c·bo, (c + 1)·bo); each is picked out by a masked lane sum (exact: one term is
    non-zero) rather than a lane slice, which Mosaic would have to realign."""
    if t.bo == 1 or t.nc == 1:
        return s
    which = lax.broadcasted_iota(jnp.int32, (1, t.nc), 1)
    block_of = lax.div(lax.broadcasted_iota(jnp.int32, (1, t.be), 1), t.bo)  # lax.div: see scale_map
    cols = jnp.zeros((1, t.be), jnp.float32)
    for c in range(t.nc):
        sc = jnp.sum(jnp.where(which == c, s, 0.0), axis=1, keepdims=True)
        cols = jnp.where(block_of == c, sc, cols)
    return cols


def _kernel(x_ref, q_ref, s_ref, o_ref, acc_ref, *, t: _Tiles, precision):
    # Blocks: x (Tp, bd); q (bd, be) int8 / fp8; s (r, 1, nc) float32; out (Tp, be); scratch acc (Tp, be) float32.
    k = pl.program_id(1)

    def product(rows: slice) -> jax.Array:
        xs = x_ref[:, rows]
        w = q_ref[rows, :].astype(xs.dtype)  # exact (module docstring)
        return lax.dot_general(xs, w, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    if t.per_step:  # r whole row blocks (static, 128-aligned slices), each scaled by its own row of scales
        part = sum(product(slice(i * t.sub, (i + 1) * t.sub)) * _column_scales(s_ref[i], t) for i in range(t.r))
    else:
        part = product(slice(None))

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += part

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        out = acc_ref[...]
        if not t.per_step:
            out = out * _column_scales(s_ref[0], t)
        o_ref[...] = out.astype(o_ref.dtype)


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, block: tuple[int, int], *, out_dtype=None,
                     block_e: int | None = None, block_d: int | None = None, vmem_limit_bytes: int | None = None,
                     interpret: Interpret = None) -> jax.Array:
    """``x @ dequantize(q, scale)`` (module docstring) in ``out_dtype`` (x's dtype unless given) as one Mosaic
    kernel. Tuning (static): ``block_e`` output columns per tile, ``block_d`` kernel rows per step (multiples of
    128 dividing E and D). ``interpret``: ``pltpu.InterpretParams()`` (or True) on CPU. Raises ValueError for
    arguments :func:`unsupported_reason` refuses in interpret mode."""
    lead, (d, e) = x.shape[:-1], q.shape
    out_dtype = x.dtype if out_dtype is None else out_dtype
    bi, bo = block = (int(block[0]), int(block[1]))
    why = unsupported_reason(x, q, scale, block, interpret=True, block_e=block_e, block_d=block_d)
    if why is not None:
        raise ValueError(f"quantized_matmul (TPU kernel): {why}")
    t = _tiles(d, e, block, block_e, block_d)
    x2 = x.reshape(-1, d)
    n = x2.shape[0]
    tp = round_up(max(n, 1), sublanes(x.dtype))
    if tp != n:
        x2 = jnp.pad(x2, ((0, tp - n), (0, 0)))
    nbi = scale.shape[0]
    s4 = scale.astype(jnp.float32).reshape(nbi, e // t.be, 1, t.nc)  # free: E / be tiles of nc scales each
    if t.per_step:  # step k's r row blocks: blocks [k·r, (k + 1)·r) of size r, or the one holding it (bd < bi)
        def scale_map(j, k):  # lax.div: k ≥ 0, and floor division's sign fix-up lowers only knowing the chip
            return lax.div(k * t.bd, bi * t.r), j, 0, 0
    else:
        def scale_map(j, k):
            return 0, j, 0, 0
    prec = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.float32 and highest_precision_requested() else None
    out = pl.pallas_call(
        functools.partial(_kernel, t=t, precision=prec),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(e // t.be, d // t.bd),
            in_specs=[pl.BlockSpec((tp, t.bd), lambda j, k: (0, k)),
                      pl.BlockSpec((t.bd, t.be), lambda j, k: (k, j)),
                      pl.BlockSpec((t.r, None, 1, t.nc), scale_map)],
            out_specs=pl.BlockSpec((tp, t.be), lambda j, k: (0, j)),
            scratch_shapes=[pltpu.VMEM((tp, t.be), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((tp, e), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret_arg(interpret),
        name="dflash_quantized_matmul",
    )(x2, q, s4)
    return out[:n].reshape(*lead, e)


def quantized_matmul_kernel(x, q, scale, block, *, out_dtype, kernels: Kernels) -> jax.Array | None:
    """The entry of the kernel dispatch (op ``"quantized_matmul"``): :func:`quantized_matmul` (TPU interpret mode
    off a TPU; on a TPU compiled alone first — it has never met a real Mosaic compiler) for calls of at most
    ``kernels.tuning.quant_kernel_max_tokens`` tokens, or None where the reference must run (more tokens, float8
    weights with ``kernels.tuning.quant_kernel_float8`` off, shapes the kernel does not take, a failed compile, or
    under a mesh: the op does not know how its kernel is split, and a custom call over sharded operands would
    gather them)."""
    interp = None if native("pallas") else pltpu.InterpretParams()
    if "pallas" not in kernels.tuning.quant_kernel_impls:
        return None  # asked not to (KernelTuning.quant_kernel_impls)
    if math.prod(x.shape[:-1]) > kernels.tuning.quant_kernel_max_tokens:
        return None  # prefill: the XLA path (not worth a log line)
    if jnp.dtype(q.dtype) == jnp.float8_e4m3fn and not kernels.tuning.quant_kernel_float8:
        return None  # turned off by the caller: not worth a log line either
    block = (int(block[0]), int(block[1]))
    local = functools.partial(quantized_matmul, block=block, out_dtype=out_dtype, interpret=interp)
    why = ("under a device mesh" if mesh_sizes() else
           unsupported_reason(x, q, scale, block, out_dtype=out_dtype, interpret=interp))
    if why is None and interp is None:
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, q, scale))
        why = compile_probe(("pallas", "quantized_matmul", block, str(jnp.dtype(out_dtype))), local, shapes)
    if why is not None:
        log_once(f"quantized matmul: the XLA reference instead of the TPU kernel ({why})")
        return None
    return local(x, q, scale)
