"""Compact mode's deferred cache write as one GPU kernel (Pallas lowered to Triton).

A compact step's tiers only read the caches; the new K/V of every layer come out of the tier switch stacked and
packed (:class:`dflash_jax.models.target.PendingKV`, ``[T, NL, 2, K, H]``) and are written after it: row ``b``'s
window (``lens[b]`` tokens from slot ``slots[b]``), then zeros up to ``W`` tokens, at its own anchor
``starts[b]``. As XLA that is an unpacking gather and two scatters a layer (60 for SmolLM2), each moving a few
hundred KB: on a GPU the embedded pair's step is launch-bound, so they cost their launches, not their bytes.
Here one kernel writes every layer's keys and values: program ``(b, l)`` copies row ``b``'s window of layer
``l``'s keys and values, a ``[W, H]`` tile per KV head read from the packed slots, into that layer's caches,
which are aliased to the outputs (written in place; nothing else of them is touched). Before it, inside each
tier's branch, :func:`place_pending` puts the tier's T slots into the largest tier's S (every branch of the
switch returns one shape) without writing the other S − T. Letters as in :mod:`dflash_jax.cuda.attention`. The entries of the kernel dispatch are
:func:`write_pending_kernel` and :func:`place_pending_kernel` (op references in :mod:`dflash_jax.kernels.cache_write`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from dflash_jax.cuda.common import SUPPORTED_DTYPES, next_pow2
from dflash_jax.kernels.common import mesh_sizes, native, run_kernel, unsharded
from dflash_jax.tuning import Kernels


def _write_kernel(starts_ref, slots_ref, lens_ref, kv_ref, *refs, layers: int, w: int, wp: int, k: int, s: int):
    # refs: the 2·NL caches as inputs (never read here), then the same 2·NL caches as outputs (aliased).
    outs = refs[2 * layers:]
    b, layer = pl.program_id(0), pl.program_id(1)  # read outside the pl.when bodies (interpret mode)
    start, slot, n = starts_ref[b], slots_ref[b], lens_ref[b]
    rows = jnp.arange(wp)
    live = (rows < w) & (start + rows < s)  # past the width or past the cache: not written
    for this in range(layers):  # a program writes one layer; the layer's refs are picked statically
        @pl.when(layer == this)
        def _():
            for part in range(2):  # keys, then values
                cache = outs[part * layers + this]
                for kh in range(k):
                    # (indices as int32 scalars: interpret mode's state discharge takes no Python ints in .at)
                    at = (pl.ds(slot, wp), jnp.int32(this), jnp.int32(part), jnp.int32(kh), slice(None))
                    tile = plgpu.load(kv_ref.at[at], mask=(rows < n)[:, None], other=0.0)  # zeros past the window
                    plgpu.store(cache.at[b, pl.ds(start, wp), jnp.int32(kh), :], tile.astype(cache.dtype),
                                mask=live[:, None])


def write_pending_unsupported_reason(kv: jax.ShapeDtypeStruct, caches: tuple, *, rows: int, interpret: bool = False
                                     ) -> str | None:
    """Why :func:`write_pending` cannot take these shapes (None: it can); ``rows``: B."""
    if not interpret and jax.default_backend() != "gpu":
        return f"needs a GPU backend (have {jax.default_backend()!r}; interpret=True runs on any backend)"
    _, layers, two, k, h = kv.shape
    if two != 2 or len(caches) != 2 * layers:
        return f"{len(caches)} caches for {layers} layers of keys and values"
    if len({tuple(c.shape) for c in caches}) != 1 or caches[0].shape[0] != rows or caches[0].shape[2:] != (k, h):
        return f"caches {sorted({tuple(c.shape) for c in caches})} are not all [{rows}, S, {k}, {h}]"
    if any(jnp.dtype(x.dtype) not in SUPPORTED_DTYPES for x in (kv, *caches)):
        return "dtypes other than bfloat16/float16/float32"
    if h < 16 or h > 256 or h & (h - 1):
        return f"head_dim {h} is not a power of two in [16, 256]"
    if layers * 2 * k > 1024:
        return f"{layers * 2 * k} (layer, K/V, head) tiles: the unrolled kernel would be too large"
    return None


def write_pending(kv: Float[Array, "T NL 2 K H"], slots: Int[Array, "B"], lens: Int[Array, "B"],
                  starts: Int[Array, "B"], k_caches: tuple, v_caches: tuple, *, width: int, interpret: bool = False
                  ) -> tuple[tuple, tuple]:
    """(k_caches, v_caches) with row b's ``kv[slots[b] + i, l]`` for i < ``lens[b]``, then zeros, up to ``width``
    tokens, written at slot ``starts[b] + i`` of layer ``l``'s caches — what :meth:`PendingKV.write` does with
    a gather and two scatters a layer — in one kernel launch (the caches are aliased to the outputs: written in
    place where the caller's buffers can be donated, as the decode loop's are)."""
    layers, k = kv.shape[1], kv.shape[3]
    caches = tuple(k_caches) + tuple(v_caches)
    b, s = caches[0].shape[:2]
    kernel = functools.partial(_write_kernel, layers=layers, w=width, wp=max(16, next_pow2(width)), k=k, s=s)
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    out = pl.pallas_call(kernel, out_shape=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches),
                         grid=(b, layers), input_output_aliases={4 + i: i for i in range(len(caches))},
                         interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                         name="dflash_write_pending_kv")(i32(starts), i32(slots), i32(lens), kv, *caches)
    return tuple(out[:layers]), tuple(out[layers:])


def _place_kernel(kv_ref, out_ref, *, rows: int, tile: int):
    i = pl.program_id(0)
    live = (i * tile + jnp.arange(tile) < rows)[:, None]
    tile_in = plgpu.load(kv_ref.at[pl.ds(i * tile, tile), :], mask=live, other=0.0)
    plgpu.store(out_ref.at[pl.ds(i * tile, tile), :], tile_in, mask=live)


def place_pending(kv: Float[Array, "T NL 2 K H"], size: int, *, interpret: bool = False
                  ) -> Float[Array, "S NL 2 K H"]:
    """``kv`` as the first T of ``size`` (S) slots; the others are left as the allocation found them (the writes
    read only each row's window: :func:`write_pending`'s masked loads). Every tier of compact's switch returns
    the largest tier's slots; XLA's pad to them wrote every slot — 23.6 MB at 64 rows of the embedded pair,
    a few percent of the step's time, whatever the tier — where this copies the tier's T."""
    t, h = kv.shape[0], kv.shape[-1]
    per_slot = kv.size // (t * h)  # rows of H a slot: NL·2·K
    rows, tile = t * per_slot, 16384 // h  # 32 KB a bfloat16 tile, whatever the (power-of-two) head size
    out = pl.pallas_call(functools.partial(_place_kernel, rows=rows, tile=tile),
                         out_shape=jax.ShapeDtypeStruct((size * per_slot, h), kv.dtype), grid=(pl.cdiv(rows, tile),),
                         interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                         name="dflash_place_pending_kv")(kv.reshape(rows, h))
    return out.reshape(size, *kv.shape[1:])


def place_pending_kernel(kv: Float[Array, "T NL 2 K H"], size: int, *, kernels: Kernels) -> jax.Array | None:
    """:func:`place_pending` where it applies (one device — compact mode's packed verify does not run under a
    mesh —, a power-of-two head size; interpret mode off a GPU), else None: the caller pads with XLA."""
    if mesh_sizes():
        return None
    interpret = not native("cuda")

    def reason(kv):
        h = kv.shape[-1]
        if jnp.dtype(kv.dtype) not in SUPPORTED_DTYPES or h < 16 or h > 256 or h & (h - 1):
            return f"{kv.dtype} K/V of head_dim {h} (needs bfloat16/float16/float32, a power of two in [16, 256])"
        return None

    return run_kernel("cuda", "compact's K/V slots", (size,), lambda kv: place_pending(kv, size, interpret=interpret),
                      reason, (kv,), unsharded(kv), once=True)


def write_pending_kernel(kv, slots, lens, starts, k_caches: tuple, v_caches: tuple, *, width: int,
                         kernels: Kernels) -> tuple[tuple, tuple] | None:
    """:func:`write_pending` where it applies (one device: compact mode's packed verify does not run under a
    mesh; interpret mode off a GPU, as the other ``impl="cuda"`` kernels), else None (the fallback's reason
    logged once): the caller writes with XLA's gather and scatters."""
    if mesh_sizes():
        return None
    interpret = not native("cuda")
    layers, rows = len(k_caches), starts.shape[0]

    def local(kv, slots, lens, starts, *caches):
        return write_pending(kv, slots, lens, starts, caches[:layers], caches[layers:], width=width,
                             interpret=interpret)

    def reason(kv, slots, lens, starts, *caches):
        return write_pending_unsupported_reason(kv, caches, rows=rows, interpret=interpret)

    args = (kv, slots, lens, starts, *k_caches, *v_caches)
    return run_kernel("cuda", "compact's cache write", (), local, reason, args, unsharded(*args), once=True)
