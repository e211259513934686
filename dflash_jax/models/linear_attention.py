"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3-Next, and the gated delta rule in pure jnp.

Dimension letters: B batch, T tokens, H value heads (Hv; keys and queries are repeated to it), Dk key width,
Dv value width, C conv channels (q, k and v, grouped by key head: see :class:`GatedDeltaNet`), R = W-1 conv
history (W the kernel), Q chunk length, N chunks.

Per head the layer keeps a state ``S [Dk, Dv]`` that every token updates (the gated delta rule):
``S ← exp(g_t)·S;  S ← S + β_t·k_t (v_t − Sᵀk_t)ᵀ;  o_t = Sᵀ q_t`` (q, k L2-normalised, q scaled by Dk^-½).
The short causal depthwise convolution before it keeps the last R inputs. So a decoding sequence is fully
described by (conv history ``[B, R, C]``, recurrent state ``[B, H, Dk, Dv]``) per layer: these replace the
KV cache of attention layers and must be exactly the states after the committed tokens.

The recurrence itself (its jnp forms — token by token, over chunks, or a short block as one chunk whose state
after any prefix is one einsum away — and the dispatch to the GPU kernel) is :mod:`dflash_jax.kernels.delta_rule`'s;
:func:`settle` takes the kernel's record (k per key head) as it is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import HybridConfig, ModelConfig
from dflash_jax.kernels.delta_rule import (delta_rule_block, delta_rule_chunked, delta_rule_sequential,
                                           kernel_block, l2norm, state_after)
from dflash_jax.kernels.packed import PackedLayout
from dflash_jax.models.layers import Dense
from dflash_jax.tuning import Kernels

__all__ = ["GatedDeltaNet", "conv_history", "delta_rule_block", "delta_rule_chunked", "delta_rule_sequential",
           "group_by_key_head", "kernel_block", "l2norm", "pad_record", "settle", "state_after"]


def conv_history(window: Float[Array, "B R+T C"], n: Int[Array, "B"] | None, r: int) -> Float[Array, "B R C"]:
    """The last ``r`` conv inputs after ``n[b]`` of the block's tokens (``None``: all of them); ``window`` is the
    previous history followed by the block's inputs."""
    if n is None:
        return window[:, window.shape[1] - r:]
    return jax.vmap(lambda w, s: jax.lax.dynamic_slice_in_dim(w, s, r, axis=0))(window, n)


def group_by_key_head(x: np.ndarray, h: HybridConfig) -> np.ndarray:
    """Conv channels along axis 0 from the checkpoints' order ``[q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]`` to the
    layer's: per key head its q, its k and its r value heads' v (``in_proj_qkv.weight [C, D]``,
    ``conv1d.weight [C, 1, W]``)."""
    kd, rest = h.key_heads * h.key_head_dim, x.shape[1:]
    per_key_head = lambda a: a.reshape(h.key_heads, -1, *rest)  # noqa: E731 — value heads j·r … j·r+r−1 for j
    return np.concatenate([per_key_head(x[:kd]), per_key_head(x[kd:2 * kd]), per_key_head(x[2 * kd:])],
                          axis=1).reshape(x.shape)


class Conv1d(nnx.Module):
    """Depthwise causal conv weights in the checkpoint's ``[C, 1, W]`` layout (PyTorch ``Conv1d``, groups = C)."""

    def __init__(self, channels: int, width: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (channels, 1, width), jnp.float32)
                                 / math.sqrt(width)).astype(dtype))

    def __call__(self, window: Float[Array, "B R+T C"], t: int) -> Float[Array, "B T C"]:
        """``out_t = Σ_j w_j · window_{t+j}``: each of the last T positions over itself and the R before it."""
        w = self.weight[...][:, 0, :].astype(jnp.float32)  # [C, W]
        width = w.shape[1]
        x = window.astype(jnp.float32)
        out = sum(x[:, j:j + t] * w[:, j] for j in range(width))
        return out.astype(window.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm over each value head, then ``· silu(z)`` (transformers' ``RMSNormGated``: the norm in float32,
    cast back and scaled, the gate applied in float32)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * x32.astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear-attention token mixer (HF names: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``; Qwen3-Next's fused projections are
    split into these when its checkpoint is read).

    The conv channels (``in_proj_qkv``'s columns, ``conv1d``'s rows, the conv history) are grouped by key head:
    per key head its q (Dk), its k (Dk), then its r = Hv/Hk value heads' v (r·Dv) — the checkpoints' order (all q,
    all k, all v) is regrouped on load (:func:`group_by_key_head`). So every per-head array of the layer splits
    into contiguous blocks of whole heads, and tensor parallelism shards the layer by key head
    (:mod:`dflash_jax.sharding`) with nothing to exchange but the all-reduce after ``out_proj``.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hybrid
        d = cfg.hidden_size
        self.hk, self.hv, self.dk, self.dv, self.width = (h.key_heads, h.value_heads, h.key_head_dim,
                                                          h.value_head_dim, h.conv_kernel)
        self.in_proj_qkv = Dense(d, h.conv_dim, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_z = Dense(d, self.hv * self.dv, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_b = Dense(d, self.hv, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_a = Dense(d, self.hv, bias=False, dtype=dtype, rngs=rngs)
        self.conv1d = Conv1d(h.conv_dim, h.conv_kernel, dtype=dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 1.0, 16.0))
                               .astype(dtype))
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Dense(self.hv * self.dv, d, bias=False, dtype=dtype, rngs=rngs)

    def zero_states(self, batch: int, dtype) -> tuple[jax.Array, jax.Array]:
        """(conv history ``[B, R, C]`` in the model dtype, recurrent state ``[B, H, Dk, Dv]`` in float32)."""
        return (jnp.zeros((batch, self.width - 1, self.in_proj_qkv.kernel.shape[1]), dtype),
                jnp.zeros((batch, self.hv, self.dk, self.dv), jnp.float32))

    def __call__(self, x: Float[Array, "B T D"], conv: jax.Array | None, rec: jax.Array | None, *,
                 lengths: Int[Array, "B"] | None = None, defer: bool = False, kernels: Kernels = Kernels(),
                 packed: PackedLayout | None = None):
        """Mix ``x`` (already input-normed) given the states before it.

        Returns ``(out, conv, rec, record)``: the states after the first ``lengths[b]`` tokens (``None``: all T;
        later tokens are identity updates, so right padding leaves no trace), or with ``defer`` the states
        unchanged plus ``record`` = ``(window, k, cum, v_new)``, from which :func:`settle` forms the states
        after any prefix once the caller knows how many tokens to keep. ``kernels``: short blocks through the
        kernel of ``kernels.impl`` where it applies (:func:`kernel_block`; its record holds k per key head),
        prompts longer than ``kernels.tuning.delta_rule_chunk`` over chunks of that many tokens.

        ``packed`` (compact mode's verify windows packed end to end; implies ``defer``): ``x`` is ``[1, T, D]``.
        The projections run over the T packed tokens; the conv and the recurrence over each row's window back in
        its ``[B, L', …]`` block (L' = ``packed.block``; zeros past a window: later positions, which no prefix
        that is kept reads); the record is that block's.
        """
        mixed = self.in_proj_qkv(x, kernels)  # [B, T, C], channels grouped by key head
        beta = jax.nn.sigmoid(self.in_proj_b(x, kernels)).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            self.in_proj_a(x, kernels).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if packed is not None:
            mixed, beta, g = (packed.unpack(a[0]) for a in (mixed, beta, g))
            defer = True
        out, conv, rec, record = self._mix(mixed, beta, g, conv, rec, lengths=lengths, defer=defer, kernels=kernels)
        if packed is not None:
            out = packed.pack(out)[None]
        b, t, _ = x.shape
        z = self.in_proj_z(x, kernels).reshape(b, t, self.hv, self.dv)
        out = self.norm(out.astype(x.dtype), z).reshape(b, t, self.hv * self.dv)
        return self.out_proj(out, kernels), conv, rec, record

    def _mix(self, mixed: Float[Array, "B T C"], beta: Float[Array, "B T H"], g: Float[Array, "B T H"], conv, rec,
             *, lengths, defer: bool, kernels: Kernels):
        """The conv and the delta rule over projected rows: ``(out [B, T, H, Dv] float32, conv, rec, record)``."""
        b, t, _ = mixed.shape
        if conv is None:
            conv, rec = self.zero_states(b, mixed.dtype)
        window = jnp.concatenate([conv.astype(mixed.dtype), mixed], axis=1)  # [B, R+T, C]
        qkv = jax.nn.silu(self.conv1d(window, t)).reshape(b, t, self.hk, -1)  # [B, T, Hk, 2Dk + r·Dv]
        chunk = kernels.tuning.delta_rule_chunk
        short = defer or t <= chunk  # one chunk: verify blocks, decode steps, short prompts
        fused = kernel_block(qkv, g, beta, rec, None if defer else lengths, key_dim=self.dk, advance=not defer,
                             kernels=kernels) if short else None
        if fused is None:
            out, rec, record = self._delta_rule(qkv, g, beta, rec, window, lengths, defer=defer, short=short,
                                                chunk=chunk)
        else:  # the GPU kernel, reading q, k, v from qkv as they lie
            out, res = fused
            record, rec = ((window, *res), rec) if defer else (None, res)
        if not defer:
            conv = conv_history(window, lengths, self.width - 1)
        return out, conv, rec, record

    def _delta_rule(self, qkv, g, beta, rec, window, lengths, *, defer: bool, short: bool, chunk: int):
        """The jnp delta rule: ``(out, rec, record)`` (one chunk when ``short``, else over ``chunk``-token chunks)."""
        b, t = qkv.shape[:2]
        q = qkv[..., :self.dk]
        k = qkv[..., self.dk:2 * self.dk]
        v = qkv[..., 2 * self.dk:].reshape(b, t, self.hv, self.dv).astype(jnp.float32)
        rep = self.hv // self.hk  # value head i reads key head i // rep (transformers' repeat_interleave)
        q = jnp.repeat(l2norm(q.astype(jnp.float32)), rep, axis=2) * (self.dk ** -0.5)
        k = jnp.repeat(l2norm(k.astype(jnp.float32)), rep, axis=2)
        record = None
        if short:
            out, (k_, cum, v_new) = delta_rule_block(q, k, v, g, beta, rec)
            if defer:
                record = (window, k_, cum, v_new)
            else:
                n = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
                rec = state_after(rec, k_, cum, v_new, n)
        else:
            if lengths is not None:  # tokens past a row's length become identity updates
                live = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
                g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
            out, rec = delta_rule_chunked(q, k, v, g, beta, rec, chunk=chunk)
        return out, rec, record


def pad_record(record: tuple, block: int) -> tuple:
    """A deferred block's record of T tokens as one of ``block`` ≥ T (zeros after: tokens no kept prefix reads),
    so that compact mode's tiers, whose windows fit blocks of different widths, return one shape."""
    return tuple(jnp.pad(a, [(0, 0), (0, block - record[1].shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in record)


def settle(conv: jax.Array, rec: jax.Array, record: tuple, n: Int[Array, "B"]) -> tuple[jax.Array, jax.Array]:
    """The (conv history, recurrent state) after the first ``n[b]`` tokens of a deferred block."""
    window, k, cum, v_new = record
    return conv_history(window, n, conv.shape[1]).astype(conv.dtype), state_after(rec, k, cum, v_new, n)
