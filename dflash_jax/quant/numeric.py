"""Making and undoing quantized kernels on the host (numpy: a checkpoint is quantized before any of it reaches a
device), and the few kernel rows a drafter's reduced head needs, dequantized on the device (jnp).

Every function takes the ``[in, out]`` kernel layout and a :class:`~dflash_jax.quant.scheme.Scheme` block
(:mod:`dflash_jax.quant.scheme`); blocks that overhang the kernel's edge (``in`` or ``out`` not a multiple of
the block) cover what is there.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dflash_jax.quant.scheme import Scheme


def _expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
    """``scale [..., nbi, nbo]`` repeated over its blocks (the last two axes) and cut to ``shape``."""
    full = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def quantize(w: np.ndarray, scheme: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """A float kernel ``w [in, out]`` → (values in ``scheme.dtype``, float32 scales ``scheme.scale_shape``):
    symmetric, each block's largest magnitude mapped to the format's largest value (int8: 127, rounded to the
    nearest integer; fp8 e4m3: 448, rounded to the nearest e4m3 value). An all-zero block gets scale 1."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize takes a [in, out] kernel, got shape {w.shape}")
    d_in, d_out = w.shape
    (bi, bo), (nbi, nbo) = scheme.blocks(d_in, d_out), scheme.scale_shape(d_in, d_out)
    padded = np.pad(np.abs(w), ((0, nbi * bi - d_in), (0, nbo * bo - d_out)))
    amax = padded.reshape(nbi, bi, nbo, bo).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / scheme.qmax, 1.0).astype(np.float32)
    x = np.clip(w / _expand(scale, (bi, bo), w.shape), -scheme.qmax, scheme.qmax)
    if scheme.kind == "int8":
        return np.rint(x).astype(np.int8), scale
    return x.astype(scheme.dtype), scale


def dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int | None, int], dtype=np.float32) -> np.ndarray:
    """``q [..., in, out]`` · its block's scale (``scale [..., nbi, nbo]``), in ``dtype`` (``block`` rows None:
    every input row). The same formula reads HF's ``[out, in]`` weights with ``weight_scale_inv`` and
    ``weight_block_size``, which is this with both axes swapped."""
    q = np.asarray(q)
    blk = (q.shape[-2] if block[0] is None else block[0], block[1])
    w = q.astype(np.float32) * _expand(np.asarray(scale, np.float32), blk, q.shape)
    return w.astype(dtype)


def dequantize_columns(q: Float[Array, "D V"], scale: Float[Array, "nbi nbo"], block: tuple[int, int],
                       ids: Int[Array, "N"], dtype) -> Float[Array, "N D"]:
    """Columns ``ids`` of a quantized ``[in, out]`` kernel, dequantized and transposed (``[N, in]``): the LM head
    rows of a reduced draft vocabulary (jnp; ``block`` resolved: rows an integer)."""
    cols = jnp.take(q, ids, axis=1).astype(jnp.float32)  # [D, N]
    s = jnp.take(scale, ids // block[1], axis=1)  # [nbi, N]
    s = jnp.repeat(s, block[0], axis=0)[: q.shape[0]]
    return (cols * s).T.astype(dtype)
