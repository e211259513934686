"""``x @ W`` for a quantized kernel ``W`` (int8 or fp8 values with float32 block scales, layout in
:mod:`dflash_jax.quant.scheme`): the jnp reference and the dispatch to kernels (op ``"quantized_matmul"``).

The reference never scales the kernel: the values are converted to the activations' dtype (exact: int8 and e4m3
values are bfloat16 and float32 numbers) as an operand of the product — a conversion XLA may fuse into the dot
or may write out, backend by backend (a kernel registered here is where that is decided) — and the scales are
applied to the products:

* one block over the input rows (per output channel, or blocks of output columns): ``(x @ q) · scale`` —
  one dot, then a scale per output column;
* several blocks over the input rows (group-wise int8, HF's 128 × 128 FP8 blocks): XLA fuses no scaling into its
  GEMM (a scaled kernel is written out whole), so the reference forms whichever temporary is the smallest:

  - the *partial products*: the input cut into the same row blocks, each block's ``x_k @ q_k`` formed
    (float32), scaled by its block's row of scales and summed — ``[nbi, N, out]`` float32, ``block``-deep dots;
  - the *scaled activations*, where the scales come in blocks of output columns that divide ``out``: per column
    block ``c``, ``(x · s[:, c]) @ q[:, c]`` — the input scaled by that column block's scales (repeated over each
    row block) in the activations' dtype, ``[nbo, N, in]``, then one batched dot of the full depth over the
    kernel as stored: half the partial products' bytes in bfloat16, and a GEMM's rate. Not for one or two rows
    (the one-token step, padded to two rows on GPUs, keeps the partial products it was timed with);
  - the *scaled kernel*: ``[in, out]`` in the activations' dtype and one dot — the smallest past ``N = in ·
    itemsize / (4 · nbi)`` rows for the partial products and past ``bo`` rows for the scaled activations (a
    verify, a prefill).

  (benchmarks/README.md, "Quantized targets".)

Products accumulate in float32 and come back in ``out_dtype`` (the activations' dtype unless asked).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from dflash_jax.kernels.dispatch import kernel
from dflash_jax.tuning import Kernels


def quantized_matmul(x: Float[Array, "*b D"], q: jax.Array, scale: Float[Array, "nbi nbo"],
                     block: tuple[int, int], *, out_dtype=None, kernels: Kernels = Kernels()
                     ) -> Float[Array, "*b E"]:
    """``x @ dequantize(q, scale)`` for ``q [D, E]`` (int8 / float8) and ``scale`` ``[ceil(D / block[0]),
    ceil(E / block[1])]``; ``block`` = (input rows, output columns) per scale, both integers."""
    _check(x, q, scale, block)
    d, e = q.shape
    out_dtype = x.dtype if out_dtype is None else out_dtype
    run = kernel("quantized_matmul", kernels)
    if run is not None:
        out = run(x, q, scale, block, out_dtype=out_dtype, kernels=kernels)
        if out is not None:
            return out
    if math.prod(x.shape[:-1]) == 1 and jax.default_backend() in kernels.tuning.pad_single_row_on:
        # As models.layers.matmul: a one-row product runs XLA's matrix-vector path, well below the bandwidth on
        # GPUs; two rows read the weights once as well.
        two = jnp.pad(x.reshape(1, d), ((0, 1), (0, 0)))
        return reference(two, q, scale, block, out_dtype)[:1].reshape(*x.shape[:-1], e)
    return reference(x, q, scale, block, out_dtype)


def quantized_projections(x: Float[Array, "*b D"], weights: Sequence[tuple[jax.Array, jax.Array, tuple[int, int]]],
                          *, out_dtype=None, kernels: Kernels = Kernels()) -> tuple[Float[Array, "*b E"], ...]:
    """``x @ dequantize(q, scale)`` for each ``(q, scale, block)`` of ``weights`` (kernels sharing the input: a
    layer's q / k / v, an MLP's gate / up): one launch where a kernel is registered for the op
    ``"quantized_projections"`` and takes them, else each through :func:`quantized_matmul` (the reference)."""
    weights = tuple((q, s, tuple(b)) for q, s, b in weights)
    run = kernel("quantized_projections", kernels) if len(weights) > 1 else None
    if run is not None:
        for q, s, b in weights:
            _check(x, q, s, b)
        out = run(x, weights, out_dtype=x.dtype if out_dtype is None else out_dtype, kernels=kernels)
        if out is not None:
            return tuple(out)
    return tuple(quantized_matmul(x, q, s, b, out_dtype=out_dtype, kernels=kernels) for q, s, b in weights)


def _check(x, q, scale, block) -> None:
    d, e = q.shape
    nbi, nbo = scale.shape
    if x.shape[-1] != d or nbi != -(-d // block[0]) or nbo != -(-e // block[1]):
        raise ValueError(f"quantized_matmul: x {x.shape}, kernel {q.shape}, scale {scale.shape} and block {block} "
                         f"do not fit")


def reference(x: Float[Array, "*b D"], q: jax.Array, scale: Float[Array, "nbi nbo"], block: tuple[int, int],
              out_dtype) -> Float[Array, "*b E"]:
    """The jnp form (module docstring)."""
    d, e = q.shape
    bi, bo = block
    nbi = scale.shape[0]
    s = scale.astype(jnp.float32)
    if bo > 1:
        s = jnp.repeat(s, bo, axis=1)[:, :e]  # [nbi, E]: a scale per output column and row block
    w = q.astype(x.dtype)
    if nbi == 1:
        y = jnp.einsum("...d,de->...e", x, w, preferred_element_type=jnp.float32) * s[0]
        return y.astype(out_dtype)
    rows = x.reshape(-1, d)
    n, item = rows.shape[0], jnp.dtype(x.dtype).itemsize
    nbo = scale.shape[1]
    partial_bytes, kernel_bytes = n * nbi * e * 4, d * e * item  # the temporaries (module docstring)
    acts_bytes = nbo * n * d * item if n > 2 and bo > 1 and e == nbo * bo else math.inf
    if acts_bytes < min(partial_bytes, kernel_bytes):
        scales = jnp.repeat(scale.astype(jnp.float32).T, bi, axis=1)[:, :d]  # [nbo, D]: a column block's, per row
        xs = (rows.astype(jnp.float32)[None] * scales[:, None, :]).astype(x.dtype)  # [nbo, N, D]
        y = jnp.einsum("cnd,dce->nce", xs, w.reshape(d, nbo, bo), preferred_element_type=jnp.float32)
        return y.astype(out_dtype).reshape(*x.shape[:-1], e)
    if kernel_bytes < partial_bytes:  # many rows: the scaled kernel is smaller
        scaled = (q.astype(jnp.float32) * jnp.repeat(s, bi, axis=0)[:d]).astype(x.dtype)  # [D, E]
        y = jnp.einsum("nd,de->ne", rows, scaled, preferred_element_type=jnp.float32)
        return y.astype(out_dtype).reshape(*x.shape[:-1], e)
    pad = nbi * bi - d
    # The block index leads (a batch dimension first: XLA's CPU dot takes bfloat16 operands with a float32
    # result only so).
    xb = jnp.pad(rows, ((0, 0), (0, pad))).reshape(-1, nbi, bi).transpose(1, 0, 2)  # [nbi, N, bi]
    wb = jnp.pad(w, ((0, pad), (0, 0))).reshape(nbi, bi, e)
    partial = jnp.einsum("knd,kde->kne", xb, wb, preferred_element_type=jnp.float32)
    return jnp.einsum("kne,ke->ne", partial, s).astype(out_dtype).reshape(*x.shape[:-1], e)
