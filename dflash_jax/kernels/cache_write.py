"""Cache writes: a row's new K/V at its own offset, and compact mode's deferred write of a packed verify's K/V.

* :func:`write_rows` — ``new`` into each row's cache at its own offset (in place under donation);
* :func:`write_pending` — every layer's pending K/V (``[T, NL, 2, K, H]``, still packed: row ``b``'s window is
  ``lens[b]`` slots from ``slots[b]``) written at each row's anchor ``starts[b]``, then zeros up to ``width``
  tokens. Reference: a gather of the windows and two scatters a layer; op ``"cache_write"`` of
  :mod:`dflash_jax.kernels.dispatch` (the GPU's one kernel for every layer, :mod:`dflash_jax.cuda.cache_write`;
  off with ``kernels.tuning.write_kernel``);
* :func:`place_pending` — a tier's T packed slots as the first T of ``size`` (every tier of compact's switch
  returns one shape). Reference: XLA's pad with zeros (each group's slots padded at their end); op
  ``"cache_place"`` (a GPU kernel that copies the T slots and leaves the rest unwritten; off with
  ``kernels.tuning.place_kernel``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from dflash_jax.kernels.dispatch import kernel
from dflash_jax.kernels.packed import gather_windows
from dflash_jax.tuning import Kernels


def write_rows(cache: Float[Array, "B S K H"], new: Float[Array, "B T K H"], start: Int[Array, "B"]) -> jax.Array:
    """Write ``new`` into each row's cache at its own offset (in place under donation)."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (s, 0, 0)))(cache, new, start)


def write_pending(kv: Float[Array, "T NL 2 K H"], slots: Int[Array, "B"], lens: Int[Array, "B"],
                  starts: Int[Array, "B"], k_caches: tuple, v_caches: tuple, *, width: int, groups: int = 1,
                  kernels: Kernels = Kernels()) -> tuple[tuple, tuple]:
    """(k_caches, v_caches) with row b's ``kv[slots[b] + i, l]`` for i < ``lens[b]``, then zeros, up to ``width``
    tokens, written at slot ``starts[b] + i`` of layer ``l``'s caches. ``groups`` (> 1 under a dp mesh): as
    :class:`~dflash_jax.kernels.packed.PackedLayout`'s, each group gathering from its own slots (the kernel
    takes one group only)."""
    run = kernel("cache_write", kernels)
    if run is not None and groups == 1:
        done = run(kv, slots, lens, starts, tuple(k_caches), tuple(v_caches), width=width, kernels=kernels)
        if done is not None:
            return done
    rows = gather_windows(kv, slots, lens, width, groups)
    return (tuple(write_rows(c, rows[:, :, i, 0], starts) for i, c in enumerate(k_caches)),
            tuple(write_rows(c, rows[:, :, i, 1], starts) for i, c in enumerate(v_caches)))


def place_pending(kv: Float[Array, "T NL 2 K H"], size: int, groups: int = 1, *, kernels: Kernels = Kernels()
                  ) -> Float[Array, "S NL 2 K H"]:
    """``kv``'s T slots within ``size`` (S ≥ T) slots: each of the ``groups`` groups' slots followed by its share
    of the S − T more, which are never read (the writes mask past each window)."""
    t = kv.shape[0]
    run = kernel("cache_place", kernels)
    if run is not None and groups == 1 and size > t:
        out = run(kv, size, kernels=kernels)
        if out is not None:
            return out
    grow = (size - t) // groups
    out = jnp.pad(kv.reshape(groups, t // groups, *kv.shape[1:]), [(0, 0), (0, grow)] + [(0, 0)] * (kv.ndim - 1))
    return out.reshape(size, *kv.shape[1:])
