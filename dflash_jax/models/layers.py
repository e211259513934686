"""Building blocks shared by the target models and the drafter.

Dimension letters used across the package (jaxtyping strings, einsum subscripts, sharding names):
B batch, T query tokens, S cache length, N query heads, K kv heads, G = N // K query heads per kv head,
H head dim, D model dim, F = (#feature layers)·D drafter feature width, I MLP hidden, V vocab,
L draft block length.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import ModelConfig, RopeConfig, rope_attention_factor
from dflash_jax.kernels.quantized import quantized_matmul, quantized_projections
from dflash_jax.quant import QuantParam, Scheme
from dflash_jax.tuning import Kernels


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], scale: float, dtype) -> jax.Array:
    return (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def matmul(x: Float[Array, "*b D"], w: Float[Array, "D E"], kernels: Kernels = Kernels(), **kw
           ) -> Float[Array, "*b E"]:
    """``x @ w`` over the last axis (``kw``: e.g. ``preferred_element_type``), one-row products padded to two
    rows on the backends of ``kernels.tuning.pad_single_row_on``.

    On GPUs XLA runs a one-row product (batch-1 decoding) through a matrix-vector kernel that reads the weights
    well below the copy bandwidth (Qwen3-8B gate/up 4096×12288 in bf16: one row takes ~1.5× as long as two), so
    such products are padded to two rows there (the extra row is free: the weights are read once either way)."""
    if math.prod(x.shape[:-1]) == 1 and jax.default_backend() in kernels.tuning.pad_single_row_on:
        two = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
        return jnp.dot(two, w, **kw)[:1].reshape(*x.shape[:-1], w.shape[-1])
    return jnp.einsum("...d,de->...e", x, w, **kw)


class Dense(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel`` stored ``[in, out]`` (PyTorch checkpoints are ``[out, in]``).

    Quantized (:meth:`set_quantized`, ``quant`` a :class:`~dflash_jax.quant.Scheme`): ``kernel`` holds int8 /
    fp8 values and ``scale`` their float32 block scales (:mod:`dflash_jax.quant.scheme`); the product is the
    kernel op :func:`~dflash_jax.kernels.quantized.quantized_matmul`, which never forms the float kernel."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(normal_init(rngs, (d_in, d_out), 1.0 / math.sqrt(d_in), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.quant: Scheme | None = None  # static: part of the graph (and the programs' key)
        self.scale: QuantParam | None = nnx.data(None)

    def set_quantized(self, scheme: Scheme, values: jax.Array, scale: jax.Array) -> None:
        """Hold ``values`` ``[in, out]`` (``scheme.dtype``) and their ``scale`` (``scheme.scale_shape``) in place of
        the float kernel (abstract arrays too: building a model's structure under ``nnx.eval_shape``)."""
        shape = tuple(self.kernel.shape)
        if tuple(values.shape) != shape or tuple(scale.shape) != scheme.scale_shape(*shape):
            raise ValueError(f"{scheme} of a {shape} kernel takes values {shape} and scales "
                             f"{scheme.scale_shape(*shape)}, got {tuple(values.shape)} and {tuple(scale.shape)}")
        self.kernel = QuantParam(values.astype(scheme.dtype))
        self.scale = QuantParam(scale.astype(jnp.float32))
        self.quant = scheme

    def project(self, x: jax.Array, kernels: Kernels = Kernels(), **kw) -> jax.Array:
        """``x @ kernel`` (no bias); ``kw``: ``preferred_element_type`` (the output dtype)."""
        if self.quant is None:
            return matmul(x, self.kernel[...], kernels, **kw)
        return quantized_matmul(x, self.kernel[...], self.scale[...], self.quant.blocks(*self.kernel.shape),
                                out_dtype=kw.get("preferred_element_type"), kernels=kernels)

    def __call__(self, x: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
        y = self.project(x, kernels)
        return y + self.bias[...] if self.bias is not None else y


def project_together(layers: tuple[Dense, ...], x: jax.Array, kernels: Kernels = Kernels()) -> tuple[jax.Array, ...]:
    """``layer(x)`` for each layer (biases included): quantized layers through the op
    :func:`~dflash_jax.kernels.quantized.quantized_projections` (one GPU launch for all of them where that kernel
    is on and takes them), float ones each alone."""
    if len(layers) > 1 and all(d.quant is not None for d in layers):
        ys = quantized_projections(x, [(d.kernel[...], d.scale[...], d.quant.blocks(*d.kernel.shape)) for d in layers],
                                   kernels=kernels)
        return tuple(y + d.bias[...] if d.bias is not None else y for y, d in zip(ys, layers))
    return tuple(d(x, kernels) for d in layers)


# Dense layers whose kernel other code reads directly, and that stay in the compute dtype when a model is
# quantized: MoE routers (precision-sensitive and tiny) and DSpark's Markov and confidence heads.
UNQUANTIZED = ("gate", "shared_expert_gate", "router", "markov_head", "confidence_head")


def quantizable(model: nnx.Module) -> list[tuple[tuple[str, ...], Dense]]:
    """The linear layers of ``model`` that quantization converts (every :class:`Dense` outside
    :data:`UNQUANTIZED`), with their paths."""
    return [(tuple(str(p) for p in path), m) for path, m in nnx.iter_graph(model)
            if isinstance(m, Dense) and not set(map(str, path)) & set(UNQUANTIZED)]


class RMSNorm(nnx.Module):
    """HF LLaMA/Qwen3 RMSNorm: normalise in float32, cast back, then scale (the order matters in bf16)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, i: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = Dense(d, i, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Dense(d, i, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Dense(i, d, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, kernels: Kernels = Kernels()) -> jax.Array:
        gate, up = project_together((self.gate_proj, self.up_proj), x, kernels)
        return self.down_proj(jax.nn.silu(gate) * up, kernels)


class Embed(nnx.Module):
    def __init__(self, vocab: int, d: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(normal_init(rngs, (vocab, d), 1.0, dtype))

    def __call__(self, ids: Int[Array, "*b"]) -> Float[Array, "*b D"]:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied lm_head: ``x @ embedding.T``."""
        return jnp.einsum("...d,vd->...v", x, self.embedding[...])


# --------------------------------------------------------------------------------------------------
# Rotary embeddings (HF "rotate_half" convention: the head dim is split in two halves)
# --------------------------------------------------------------------------------------------------

def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> np.ndarray:
    """Inverse frequencies [H/2] for the default, linear, llama3 and yarn variants (as HF computes them)."""
    dim = head_dim
    inv = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if rope.kind == "default":
        return inv
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        old = rope.original_max_position_embeddings or max_position_embeddings  # as transformers 5
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * out / rope.factor + smooth * out
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, out).astype(np.float32)
    if rope.kind == "yarn":
        orig = rope.original_max_position_embeddings or max_position_embeddings
        factor = rope.factor

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(rope.theta))

        low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
        extrap, interp = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrap_factor = 1 - ramp
        return (interp * (1 - extrap_factor) + extrap * extrap_factor).astype(np.float32)
    raise ValueError(f"unknown rope kind {rope.kind}")


class Rope:
    """Precomputed inverse frequencies; ``__call__(positions)`` gives cos/sin ``[..., H]`` in float32.

    Hashable (a static part of the module graph): frequencies are kept as a tuple of floats.
    """

    def __init__(self, cfg: ModelConfig):
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings))
        self.scale = rope_attention_factor(cfg.rope)

    def __eq__(self, other) -> bool:
        return isinstance(other, Rope) and (self.inv_freq, self.scale) == (other.inv_freq, other.scale)

    def __hash__(self) -> int:
        return hash((self.inv_freq, self.scale))

    def __call__(self, positions: Int[Array, "*p"]) -> tuple[jax.Array, jax.Array]:
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq, jnp.float32)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb) * self.scale, jnp.sin(emb) * self.scale


def apply_rope(x: Float[Array, "B T n H"], cos: Float[Array, "B T H"], sin: Float[Array, "B T H"]) -> jax.Array:
    """Rotate ``x`` (any number of heads on axis 2); computed in float32 like HF, cast back."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)
