"""The K largest entries of the last axis (op ``"top_k"``): a DFlash2 drafter's candidates, the top-K of the LM
head's logits over the whole vocabulary at every block position.

The reference is :func:`jax.lax.top_k`: values best first, ties taken in index order (the lowest index first),
floats in the total order (``+0 > -0``). A kernel must return exactly what it returns (same values, same
indices), so the op is free to pick either.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from dflash_jax.kernels.dispatch import kernel
from dflash_jax.tuning import Kernels


def top_k(x: Float[Array, "*b V"], k: int, *, kernels: Kernels = Kernels()
          ) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    """(values, int32 indices) of the ``k`` largest entries of each row of ``x``, as :func:`jax.lax.top_k`."""
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"top_k: k = {k} must be in [1, {x.shape[-1]}] (the last axis of {x.shape})")
    run = kernel("top_k", kernels)
    if run is not None:
        out = run(x, k, kernels=kernels)
        if out is not None:
            return out
    return reference(x, k)


def reference(x: Float[Array, "*b V"], k: int) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    return jax.lax.top_k(x, k)
