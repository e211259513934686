"""Compact mode's packed verify windows (:mod:`dflash_jax.decode.schedule`): their layout and their attention.

* :class:`PackedLayout` — each row's verify window packed end to end into the T slots of a compiled tier (or,
  in a tier with room for every whole block, left in its block: the dense layout);
* :func:`packed_verify_attention` — the windows' attention over a cache that is only read (each window's own
  K/V beside it, written after the tier's conditional): draft attention's form, causal; the reference is
  :func:`~dflash_jax.kernels.attention.draft_attention` on the unpacked blocks, the GPU kernel reads and
  writes the packed rows itself (op ``"packed_verify_attention"`` of :mod:`dflash_jax.kernels.dispatch`);
* :func:`packed_verify` — a decoder layer's call of it, with the windows' new K/V for the deferred write
  (:mod:`dflash_jax.kernels.cache_write`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from dflash_jax.kernels.attention import draft_attention
from dflash_jax.kernels.common import find_bucket
from dflash_jax.kernels.dispatch import kernel
from dflash_jax.tuning import Kernels, KernelTuning


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Each row's verify window (its first ℓ_r block tokens) packed end to end into T slots (a compiled tier).
    Slot t holds block token ``offsets[t]`` of row ``rows[t]``; row r's window starts at slot ``starts[r]``.

    ``dense`` (a tier with room for every row's whole block, T ≥ B·L): the windows stay in their rows' blocks,
    slot ``r·L + i`` holding row r's token i, valid while i < ℓ_r — packing and unpacking are reshapes, where
    gathering every token would buy nothing: the static verify's form, in a tier (the GPU kernel takes its
    rows as windows of whole blocks).

    ``groups`` > 1 (compact mode under a dp mesh): rows and slots split into that many equal groups, in order —
    group g's rows ``g·B/G …`` pack into its own slots ``g·T/G …`` (padding at the end of each group's slots), so
    packing, unpacking and the cache writes stay on the device that holds the group's rows."""

    starts: Int[Array, "B"]
    lens: Int[Array, "B"]  # ℓ_r
    kv_lens: Int[Array, "B"]  # anchor position + ℓ_r: the row's cache length once its window is written
    rows: Int[Array, "T"]  # padding: a row of the slot's group (its values are never used)
    offsets: Int[Array, "T"]  # padding: 0
    valid: Bool[Array, "T"]
    block: int = dataclasses.field(metadata=dict(static=True))  # L: the longest possible window
    groups: int = dataclasses.field(default=1, metadata=dict(static=True))
    dense: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def build(lens: Int[Array, "B"], anchor_pos: Int[Array, "B"], size: int, block: int, groups: int = 1,
              tuning: KernelTuning = KernelTuning()) -> "PackedLayout":
        """``lens``: ℓ_r ∈ [0, L] per row (0: the row verifies nothing); ``size``: T, with each group's Σ ℓ_r ≤
        T / ``groups``; a size of B·L or more gives the dense layout (of B·L slots) unless
        ``tuning.dense_whole_blocks`` is off (A/B runs)."""
        b = lens.shape[0]
        lens = lens.astype(jnp.int32)
        kv_lens = (anchor_pos + lens).astype(jnp.int32)
        if tuning.dense_whole_blocks and size >= b * block:
            rows = jnp.asarray(np.repeat(np.arange(b, dtype=np.int32), block))  # constants
            offsets = jnp.asarray(np.tile(np.arange(block, dtype=np.int32), b))
            return PackedLayout(jnp.asarray(np.arange(b, dtype=np.int32) * block), lens, kv_lens, rows, offsets,
                                offsets < lens[rows], block, groups, dense=True)
        bg, tg = b // groups, size // groups
        cu = jnp.concatenate([jnp.zeros((groups, 1), jnp.int32), jnp.cumsum(lens.reshape(groups, bg), axis=1)],
                             axis=1)  # [G, B/G + 1]: each group's window bounds in its own slots
        slot = jnp.arange(tg, dtype=jnp.int32)
        local = jax.vmap(lambda c: jnp.clip(find_bucket(c, slot, side="right", tuning=tuning) - 1, 0, bg - 1))(cu)
        valid = slot[None, :] < cu[:, bg:]
        offsets = jnp.where(valid, slot[None, :] - jnp.take_along_axis(cu, local, axis=1), 0)
        group = jnp.arange(groups, dtype=jnp.int32)[:, None]
        return PackedLayout((cu[:, :-1] + group * tg).reshape(b), lens, kv_lens,
                            (local + group * bg).reshape(size).astype(jnp.int32), offsets.reshape(size),
                            valid.reshape(size), block, groups)

    @property
    def cu_q_lens(self) -> Int[Array, "B+1"]:
        """The windows' slot bounds for the kernels (one group of windows end to end; a dense layout's rows
        as windows of whole blocks, ``r·L``)."""
        if self.groups != 1:
            raise ValueError("cu_q_lens describes one group of windows packed end to end")
        return jnp.concatenate([self.starts, self.starts[-1:] + (self.block if self.dense else self.lens[-1:])])

    @property
    def anchors(self) -> Int[Array, "B"]:
        """Each row's anchor position (its window's first): the cache holds what lies before it."""
        return self.kv_lens - self.lens

    @property
    def positions(self) -> Int[Array, "T"]:
        """Absolute position of each slot's token (padding: its row's anchor position)."""
        return self.anchors[self.rows] + self.offsets

    def local_rows(self) -> Int[Array, "T"]:
        """Each slot's row within its group."""
        if self.groups == 1:
            return self.rows
        t, bg = self.rows.shape[0], self.starts.shape[0] // self.groups
        return self.rows - (jnp.arange(t, dtype=jnp.int32) // (t // self.groups)) * bg

    def pack(self, x: Float[Array, "B L *f"]) -> Float[Array, "T *f"]:
        """``x``'s rows' windows (L ≥ ``block``: tokens from ``block`` on are never packed)."""
        if self.dense:
            return x[:, :self.block].reshape(-1, *x.shape[2:])
        if self.groups == 1:
            return x[self.rows, self.offsets]
        g = self.groups
        out = jax.vmap(lambda xg, r, o: xg[r, o])(x.reshape(g, -1, *x.shape[1:]), self.local_rows().reshape(g, -1),
                                                  self.offsets.reshape(g, -1))
        return out.reshape(-1, *out.shape[2:])

    def unpack(self, y: Float[Array, "T *f"]) -> Float[Array, "B L *f"]:
        """Back to ``[B, L, …]``; block slots past a row's window hold zeros."""
        if not self.dense:
            return gather_windows(y, self.starts, self.lens, self.block, self.groups)
        out = y.reshape(self.starts.shape[0], self.block, *y.shape[1:])
        inside = jnp.arange(self.block)[None, :] < self.lens[:, None]
        return jnp.where(inside.reshape(inside.shape + (1,) * (y.ndim - 1)), out, jnp.zeros((), y.dtype))


def gather_windows(y: Float[Array, "T *f"], starts: Int[Array, "B"], lens: Int[Array, "B"], width: int,
                   groups: int = 1) -> Float[Array, "B W *f"]:
    """Each row's window out of packed slots: row r's ``lens[r]`` slots from slot ``starts[r]``, then zeros, to
    ``width`` (W) tokens. With ``groups`` > 1 (:class:`PackedLayout`'s) each group gathers from its own T/groups
    slots, so nothing crosses the devices of a dp mesh."""
    t, b = y.shape[0], starts.shape[0]
    j = jnp.arange(width)[None, :]
    if groups == 1:
        out = y[jnp.clip(starts[:, None] + j, 0, t - 1)]
    else:
        tg, bg = t // groups, b // groups
        first = starts - (jnp.arange(b) // bg) * tg  # in the group's own slots
        out = jax.vmap(lambda yg, f: yg[jnp.clip(f[:, None] + j, 0, tg - 1)])(
            y.reshape(groups, tg, *y.shape[1:]), first.reshape(groups, bg))
        out = out.reshape(-1, *out.shape[2:])
    inside = j < lens[:, None]
    return jnp.where(inside.reshape(inside.shape + (1,) * (y.ndim - 1)), out, jnp.zeros((), y.dtype))


def split_qkv(qkv: Float[Array, "T N+2K H"], kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(queries [T, N, H], keys [T, K, H], values [T, K, H]) of the packed verify's one operand."""
    n = qkv.shape[1] - 2 * kv_heads
    return qkv[:, :n], qkv[:, n:n + kv_heads], qkv[:, n + kv_heads:]


def packed_kv(qkv: Float[Array, "T N+2K H"], kv_heads: int) -> Float[Array, "T 2 K H"]:
    """The keys and values of the packed verify's operand as one slice, for
    :class:`dflash_jax.models.target.PendingKV` (whose stack over the layers reads it: no kernel of its own)."""
    t, heads, h = qkv.shape
    return qkv[:, heads - 2 * kv_heads:].reshape(t, 2, kv_heads, h)


def packed_verify(q: Float[Array, "1 T N H"], k: Float[Array, "1 T K H"], v: Float[Array, "1 T K H"],
                  k_cache: Float[Array, "B S K H"], v_cache: Float[Array, "B S K H"], layout: PackedLayout, *,
                  kernels: Kernels, sinks: Float[Array, "N"] | None = None, window: int | None = None
                  ) -> tuple[Float[Array, "1 T N H"], Float[Array, "T 2 K H"]]:
    """A decoder layer's packed verify (rotary embedding applied): (its attention output, the windows' new K/V
    for :class:`dflash_jax.models.target.PendingKV`). Queries, keys and values go in as one ``[T, N + 2K, H]``
    operand, which one fusion writes; the barrier keeps it one buffer — XLA would otherwise rewrite PendingKV's
    slice of it into a concatenation of K and V of their own, one more kernel a layer in the packed tiers."""
    qkv = jax.lax.optimization_barrier(jnp.concatenate([q[0], k[0], v[0]], axis=1))
    out = packed_verify_attention(qkv, k_cache, v_cache, layout, kernels=kernels, sinks=sinks, window=window)
    return out[None], packed_kv(qkv, k.shape[2])


def packed_verify_attention(
    qkv: Float[Array, "T N+2K H"],
    k_cache: Float[Array, "B S K H"],
    v_cache: Float[Array, "B S K H"],
    layout: PackedLayout,
    *,
    kernels: Kernels = Kernels(),
    sinks: Float[Array, "N"] | None = None,
    window: int | None = None,
) -> Float[Array, "T N H"]:
    """Verify attention of packed windows whose own keys and values are *not* in the cache: slot t attends to
    its row's cache before the window (positions < the anchor's, written by earlier steps) and causally to its
    window's K/V. ``qkv``: each slot's queries, keys and values as the heads of one operand (rotary embedding
    applied; :func:`split_qkv`), which one fusion of the projection's output writes. The cache is only read,
    so a compiled tier (a branch of a ``lax.switch``) can run this and leave the write to after the
    conditional (:class:`dflash_jax.models.target.PendingKV`): a branch that writes a buffer gets its own copy
    of it from XLA, every cache of every layer each step.

    With a packed-verify kernel registered for ``kernels.impl`` (the GPU's: no sinks, no mesh; off with
    ``kernels.tuning.packed_kernel``) one kernel reads and writes the packed rows itself (padding slots get
    zeros). Otherwise the windows go back into their ``[B, L]`` block (zeros past a window: masked, as the block
    is causal) for :func:`~dflash_jax.kernels.attention.draft_attention` — the block kernels (causal, sliding
    window) under ``kernels.impl``, the reference with ``sinks``; padding slots give their row's outputs and are
    never used."""
    start = layout.anchors
    run = kernel("packed_verify_attention", kernels)
    if run is not None and sinks is None and layout.groups == 1:
        out = run(qkv, k_cache, v_cache, layout.cu_q_lens, start, max_q_len=layout.block, window=window,
                  kernels=kernels)
        if out is not None:
            return out
    q, k, v = split_qkv(qkv, k_cache.shape[2])
    positions = start[:, None] + jnp.arange(layout.block, dtype=jnp.int32)[None, :]
    out = draft_attention(layout.unpack(q), k_cache, v_cache, layout.unpack(k), layout.unpack(v),
                          positions, start, causal=True, window=window, kernels=kernels, sinks=sinks,
                          once=True)  # traced in every tier of the switch
    return layout.pack(out)
