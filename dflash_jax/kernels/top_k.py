"""The K largest entries of the last axis (op ``"top_k"``): a DFlash2 drafter's candidates, the top-K of the LM
head's logits over the whole vocabulary at every block position; and the head and that top-K together (op
``"head_top_k"``).

The reference of ``"top_k"`` is :func:`jax.lax.top_k`: values best first, ties taken in index order (the lowest
index first), floats in the total order (``+0 > -0``). A kernel must return exactly what it returns (same values,
same indices), so the op is free to pick either. ``"head_top_k"``'s reference forms the float32 logits ``h @ w``
and runs ``"top_k"`` on them; its kernel forms the logits itself (its own summation order), so near-ties may
order differently: candidates for drafting, whose every draft the target verifies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def head_top_k(h: Float[Array, "*b D"], w: jax.Array, k: int, *, vocab_major: bool, kernels: Kernels = Kernels()
               ) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    """(float32 values, int32 ids) of the ``k`` largest logits ``h @ w`` of each row: ``w`` the LM head's
    weights, ``[D, V]``, or ``[V, D]`` with ``vocab_major`` (a tied embedding)."""
    v = w.shape[0] if vocab_major else w.shape[1]
    if not 1 <= k <= v:
        raise ValueError(f"head_top_k: k = {k} must be in [1, {v}] (the head's vocabulary)")
    run = kernel("head_top_k", kernels)
    if run is not None:
        out = run(h, w, k, vocab_major=vocab_major, kernels=kernels)
        if out is not None:
            return out
    # As TargetModel.logits forms them (the same product, so the same numbers as the unfused path).
    logits = jnp.einsum("...d,dv->...v", h, w.T if vocab_major else w, preferred_element_type=jnp.float32)
    return top_k(logits, k, kernels=kernels)


def reference(x: Float[Array, "*b V"], k: int) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    return jax.lax.top_k(x, k)
