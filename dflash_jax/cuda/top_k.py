"""The exact two-stage top-K over a long last axis (op ``"top_k"``, :mod:`dflash_jax.kernels.top_k`): the top-K
of each chunk of ``C`` columns, then the top-K of those candidates. Written in jnp (XLA's TopK does each stage).

Why: a DFlash2 drafter takes the top-K of the LM head's logits over the whole vocabulary at every block position.
XLA's GPU TopK works row by row, so at batch 1 (a block's 15–16 rows) a handful of rows each scan the whole
vocabulary while most of the GPU idles; cut into chunks the same work is V / C times as many short rows.

Exactness: an entry among the top K of its row (values descending, ties by the lowest index) has fewer than K
entries before it in that order in the whole row, so fewer than K in its chunk: it is among its chunk's top K.
The candidates are laid out chunk by chunk, each chunk's best first, so among equal values a candidate's
position follows its column: the second stage's ties (lowest position first) are the row's ties. Both stages are
``lax.top_k``, so the order of the floats (``+0 > -0``) is the reference's too. A ragged last chunk is padded
with ``-inf``: padded columns come after every real column equal to them and there are at least K real
candidates (every chunk but the last is whole and gives K), so none is picked — for inputs without NaN (a
negative NaN orders below ``-inf``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def chunk_width(v: int, chunk: int) -> int:
    """The chunk for a last axis of ``v``: the largest divisor of ``v`` in ``[chunk / 2, chunk]`` when there is
    one (no padded copy of the input), else ``chunk`` (the last chunk padded)."""
    for c in range(chunk, (chunk + 1) // 2 - 1, -1):
        if v % c == 0:
            return c
    return chunk


def chunked_top_k(x: Float[Array, "*b V"], k: int, chunk: int
                  ) -> tuple[Float[Array, "*b k"], Int[Array, "*b k"]]:
    """(values, int32 indices) of the ``k`` largest entries of each row, as ``lax.top_k``, from chunks of
    ``chunk`` columns (``k ≤ chunk``; the last chunk padded with ``-inf`` if ``chunk`` does not divide V)."""
    *lead, v = x.shape
    if not 1 <= k <= min(chunk, v):
        raise ValueError(f"chunked_top_k: k = {k} must be in [1, min(chunk {chunk}, V {v})]")
    n_chunks = -(-v // chunk)
    rows = x.reshape(-1, v)
    if n_chunks * chunk != v:
        rows = jnp.pad(rows, ((0, 0), (0, n_chunks * chunk - v)), constant_values=-jnp.inf)
    # Stage 1 on a 2-D operand (rows × chunks, chunk): the layout XLA's GPU TopK takes as is.
    vals, idx = jax.lax.top_k(rows.reshape(-1, chunk), k)  # [N · n_chunks, k]
    vals = vals.reshape(-1, n_chunks * k)
    idx = (idx.reshape(-1, n_chunks, k) + (jnp.arange(n_chunks, dtype=jnp.int32) * chunk)[:, None])
    best, at = jax.lax.top_k(vals, k)  # [N, k]
    ids = jnp.take_along_axis(idx.reshape(-1, n_chunks * k), at, axis=-1)
    return best.reshape(*lead, k), ids.reshape(*lead, k)


def chunked_top_k_kernel(x: Float[Array, "*b V"], k: int, *, kernels) -> tuple[jax.Array, jax.Array] | None:
    """The dispatch's entry: :func:`chunked_top_k` with chunks of about ``kernels.tuning.top_k_chunk`` columns
    (:func:`chunk_width`), or None (lax.top_k runs) for a row of one chunk, a ``k`` above the chunk, a
    non-float input or more rows than ``kernels.tuning.top_k_chunked_max_rows``."""
    v = x.shape[-1]
    chunk = chunk_width(v, kernels.tuning.top_k_chunk)
    rows, most = x.size // max(v, 1), kernels.tuning.top_k_chunked_max_rows
    if v <= chunk or k > chunk or not jnp.issubdtype(x.dtype, jnp.floating) or (most and rows > most):
        return None
    return chunked_top_k(x, k, chunk)
