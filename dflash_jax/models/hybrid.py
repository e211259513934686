"""Hybrid targets: Qwen3.5 / Qwen3.6 (``qwen3_5_text``, ``qwen3_5_moe_text``) and Qwen3-Next (``qwen3_next``).

Layers follow ``layer_types``: Gated DeltaNet linear attention (:mod:`dflash_jax.models.linear_attention`) or gated
full attention (an output gate ``sigmoid(g)`` from a doubled ``q_proj``, q/k norms, rotary embeddings on the first
``rotary_dim`` dims of each head only); dense SwiGLU or sparse MoE with a shared expert after either. Every
RMSNorm except the DeltaNet's gated one scales by ``1 + w`` (weights stored zero-centred).

The cache (:class:`HybridCache`) is a :class:`~dflash_jax.models.target.KVCache` holding K/V for the full-attention
layers only, plus per linear layer its conv history and recurrent state. Those states cannot be "overwritten
later" like K/V slots, so a verify forward runs with ``defer=True``: the states stay as they were and the cache
carries ``pending`` records; :meth:`HybridTargetModel.settle` then forms the states after each row's accepted
prefix. Prefill passes ``lengths`` instead: a row's tokens past its length do not touch its states.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import ModelConfig
from dflash_jax.kernels.attention import cache_attention, prefill_attention, read_after
from dflash_jax.kernels.packed import PackedLayout, packed_verify
from dflash_jax.models import linear_attention as la
from dflash_jax.models.layers import MLP, Dense, Embed, Rope, apply_rope, project_together
from dflash_jax.models.moe import SparseMoE
from dflash_jax.models.target import KVCache, PendingKV, TargetModel, write_rows
from dflash_jax.quant import SCALE_SUFFIX
from dflash_jax.sharding import Plan, constrain
from dflash_jax.tuning import Kernels

log = logging.getLogger("dflash_jax")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache(KVCache):
    """K/V ``[B, S, K, H]`` of the full-attention layers (in layer order), and per linear-attention layer the conv
    history ``[B, W-1, C]`` (model dtype) and recurrent state ``[B, Hv, Dk, Dv]`` (float32). ``pending`` is empty
    except between a deferred forward and :meth:`HybridTargetModel.settle`."""

    conv: tuple[jax.Array, ...] = ()
    recurrent: tuple[jax.Array, ...] = ()
    pending: tuple = ()

    def constrained(self, plan: Plan, sharded_heads: bool) -> "HybridCache":
        """As :meth:`KVCache.constrained`; the linear-attention states by row, and by head where tp splits them."""
        out = super().constrained(plan, sharded_heads)
        return dataclasses.replace(out, conv=tuple(constrain(x, plan.conv_history()) for x in self.conv),
                                   recurrent=tuple(constrain(x, plan.recurrent()) for x in self.recurrent))


class ZeroCenteredRMSNorm(nnx.Module):
    """Qwen3.5 / Qwen3-Next RMSNorm: ``norm(x) · (1 + w)`` in float32, then cast (weights stored around 0)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def apply_partial_rope(x: Float[Array, "B T n H"], cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``cos.shape[-1]`` dims of each head, pass the rest through."""
    r = cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)


class GatedAttention(nnx.Module):
    """Full attention with an output gate: ``q_proj`` gives ``[q_h ; gate_h]`` per head, the output is
    ``o_proj(attn · sigmoid(gate))``; q and k pass their zero-centred norms before the partial rotation."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Dense(d, n * h * 2, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Dense(d, k * h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Dense(d, k * h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Dense(n * h, d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.q_norm = ZeroCenteredRMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.n, self.k, self.h = n, k, h

    def __call__(self, x, positions, cos, sin, k_cache, v_cache, *, prefill: bool, kernels: Kernels,
                 packed: PackedLayout | None = None):
        b, t, _ = x.shape
        qg, k, v = project_together((self.q_proj, self.k_proj, self.v_proj), x, kernels)
        qg = qg.reshape(b, t, self.n, 2 * self.h)
        q, gate = qg[..., :self.h], qg[..., self.h:].reshape(b, t, self.n * self.h)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(k.reshape(b, t, self.k, self.h)), cos, sin)
        v = v.reshape(b, t, self.k, self.h)
        if packed is not None:  # as target.Attention: the cache is only read; the new K/V are returned
            out, new_kv = packed_verify(q, k, v, *read_after(x, k_cache, v_cache, kernels), packed, kernels=kernels)
            k_cache = v_cache = new_kv
        elif prefill:  # as target.Attention: the prompt's own keys, then stored
            out = prefill_attention(q, k, v, positions, kernels=kernels)
            if k_cache is not None:
                k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0))
                v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0))
        else:
            k_cache = write_rows(k_cache, k, positions[:, 0])
            v_cache = write_rows(v_cache, v, positions[:, 0])
            out = cache_attention(q, k_cache, v_cache, positions, kernels=kernels)
        out = out.reshape(b, t, self.n * self.h) * jax.nn.sigmoid(gate)
        return self.o_proj(out, kernels), k_cache, v_cache


class HybridDecoderLayer(nnx.Module):
    """Pre-norm token mixer (``linear_attn`` or ``self_attn``, from ``layer_types``) + MLP or sparse MoE."""

    def __init__(self, cfg: ModelConfig, idx: int, *, dtype, rngs: nnx.Rngs):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.linear = cfg.hybrid.is_linear(idx)
        self.input_layernorm = ZeroCenteredRMSNorm(d, eps=eps, dtype=dtype)
        self.linear_attn = la.GatedDeltaNet(cfg, dtype=dtype, rngs=rngs) if self.linear else None
        self.self_attn = None if self.linear else GatedAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(d, eps=eps, dtype=dtype)
        if cfg.is_moe_layer(idx):
            self.mlp = SparseMoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(d, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cos, sin, slot: tuple, *, prefill: bool, kernels: Kernels, lengths,
                 defer: bool, packed: PackedLayout | None = None):
        """``slot``: (k_cache, v_cache) or (conv, recurrent); returns (x, slot, record or None) — with ``packed``,
        an attention layer's slot holds its new K/V instead."""
        h = self.input_layernorm(x)
        record = None
        if self.linear:
            a, conv, rec, record = self.linear_attn(h, *slot, lengths=lengths, defer=defer, kernels=kernels,
                                                    packed=packed)
            slot = (conv, rec)
        else:
            a, kc, vc = self.self_attn(h, positions, cos, sin, *slot, prefill=prefill, kernels=kernels, packed=packed)
            slot = (kc, vc)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x), kernels), slot, record


class HybridTargetModel(TargetModel):
    """A Qwen3.5 / Qwen3.6 / Qwen3-Next causal LM (text part). Same interface as :class:`TargetModel`, plus
    ``lengths`` / ``defer`` on the forward and :meth:`settle` for the linear layers' states."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([HybridDecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                   dtype=dtype, rngs=rngs)
        self.rope = Rope(dataclasses.replace(cfg, head_dim=cfg.hybrid.rotary_dim))

    def _slots(self) -> list[int]:
        """Per layer its index among the layers of its own kind (K/V slots, state slots)."""
        counts, out = {True: 0, False: 0}, []
        for layer in self.layers:
            out.append(counts[layer.linear])
            counts[layer.linear] += 1
        return out

    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        c = self.config
        n_attn = sum(not layer.linear for layer in self.layers)
        kv = KVCache.zeros(n_attn, batch, capacity, c.num_kv_heads, c.head_dim, self.dtype)
        states = [layer.linear_attn.zero_states(batch, self.dtype) for layer in self.layers if layer.linear]
        return HybridCache(kv.k, kv.v, tuple(s[0] for s in states), tuple(s[1] for s in states))

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: HybridCache | None,
        *,
        capture: tuple[int, ...] = (),
        prefill: bool = False,
        kernels: Kernels = Kernels(),
        lengths: Int[Array, "B"] | None = None,
        defer: bool = False,
        packed: PackedLayout | None = None,
    ) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"] | None, HybridCache | PendingKV | None]:
        """As :meth:`TargetModel.__call__`. The linear layers' states advance over the first ``lengths[b]`` tokens
        of each row (``None``: all of them); with ``defer`` they stay put and the returned cache carries the
        records that :meth:`settle` needs (a verify block, whose accepted length is not known yet). ``packed``
        (compact mode's windows; deferred): nothing is written — the attention layers' new K/V and the linear
        layers' records come back as a :class:`PendingKV`, whose ``write`` gives the cache to :meth:`settle`."""
        if cache is None and not prefill:
            raise ValueError("a cache is required unless prefill=True")
        if (defer or packed is not None) and (cache is None or lengths is not None):
            raise ValueError("defer and packed need a cache and no lengths")
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        n = self.config.num_layers
        slots = self._slots()
        if cache is not None:
            kv, states = (list(cache.k), list(cache.v)), (list(cache.conv), list(cache.recurrent))
        else:
            kv = ([None] * n, [None] * n)
            states = ([None] * n, [None] * n)
        pending, captured = [], {}
        for i, layer in enumerate(self.layers):
            store, j = (states if layer.linear else kv), slots[i]
            x, (store[0][j], store[1][j]), record = layer(
                x, positions, cos, sin, (store[0][j], store[1][j]), prefill=prefill, kernels=kernels, lengths=lengths,
                defer=defer, packed=packed)
            if record is not None:
                pending.append(record)
            if i in capture and i != n - 1:
                captured[i] = x
        h = self.norm(x)
        if n - 1 in capture:
            captured[n - 1] = h
        feats = jnp.concatenate([captured[i] for i in capture], axis=-1) if capture else None
        if cache is None:
            return h, feats, None
        if packed is not None:
            return h, feats, PendingKV.of(packed, tuple(kv[0]), tuple(pending))  # each layer's [T, 2, K, H]
        return h, feats, HybridCache(tuple(kv[0]), tuple(kv[1]), tuple(states[0]), tuple(states[1]), tuple(pending))

    def settle(self, cache: HybridCache, n: Int[Array, "B"]) -> HybridCache:
        """The cache after a deferred forward, its linear states advanced over the first ``n[b]`` tokens of the
        block (a verify: the anchor and the accepted drafts; the bonus is the next block's anchor)."""
        if not cache.pending:
            return cache
        new = [la.settle(c, r, rec, n) for c, r, rec in zip(cache.conv, cache.recurrent, cache.pending)]
        return dataclasses.replace(cache, conv=tuple(s[0] for s in new), recurrent=tuple(s[1] for s in new),
                                   pending=())


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------

_LM_PREFIXES = ("model.language_model.", "language_model.model.")  # the text part inside VL checkpoints
_UNUSED = {"vision tower": ("model.visual.", "visual.", "model.vision_tower."), "MTP head": ("mtp.", "model.mtp.")}


def text_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: str):
    """A Qwen3.5 / Qwen3-Next checkpoint's tensors in our names (``model.`` + HF text-model names), and the
    predicate of those to ignore.

    Vision-language checkpoints hold the language model under ``model.language_model.`` (its lm_head at the top);
    their vision tower and the multi-token-prediction head are not used (one log line says how many tensors
    that leaves out). Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are split into Qwen3.5's four
    projections. The conv channels of ``in_proj_qkv`` and ``conv1d`` are then grouped by key head, the order
    :class:`~dflash_jax.models.linear_attention.GatedDeltaNet` computes in. An FP8 checkpoint's scales
    (``…_scale_inv``, one row per weight row here) are renamed, split and grouped with their weights.
    """
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        for p in _LM_PREFIXES:
            if name.startswith(p):
                name = "model." + name[len(p):]
        if name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        out[name] = arr
    if cfg.hybrid.fused_projections:
        _split_fused(cfg, out)
    grouped = (".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_qkv.weight" + SCALE_SUFFIX,
               ".linear_attn.conv1d.weight")
    for name in [n for n in out if n.endswith(grouped)]:
        out[name] = la.group_by_key_head(out[name], cfg.hybrid)  # the layer's channel order
    counts = {what: sum(n.startswith(prefixes) for n in out) for what, prefixes in _UNUSED.items()}
    if any(counts.values()):
        log.info("%s: ignoring %s (not used by the text model)", source,
                 ", ".join(f"{c} tensors of the {what}" for what, c in counts.items() if c))
    unused = tuple(p for prefixes in _UNUSED.values() for p in prefixes)
    tied = cfg.tie_word_embeddings
    return out, lambda name: name.startswith(unused) or (tied and name == "lm_head.weight")


def _split_fused(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
    """Qwen3-Next ``in_proj_qkvz`` ``[Hk·(2Dk + 2r·Dv), D]`` (rows grouped by key head: q, k, then its r value
    heads' v and z) and ``in_proj_ba`` ``[Hk·2r, D]`` → ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` (in place; an FP8 weight's row scales split with it)."""
    h = cfg.hybrid
    r = h.value_heads // h.key_heads
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    for name in [n for n in tensors if n.endswith(".linear_attn.in_proj_qkvz.weight")]:
        base = name[: -len("in_proj_qkvz.weight")]
        for suffix in ("", SCALE_SUFFIX):
            if base + "in_proj_qkvz.weight" + suffix in tensors:
                w = tensors.pop(base + "in_proj_qkvz.weight" + suffix)
                w = w.reshape(h.key_heads, 2 * h.key_head_dim + 2 * r * h.value_head_dim, -1)
                q, k, v, z = np.split(w, np.cumsum([h.key_head_dim, h.key_head_dim, r * h.value_head_dim]), axis=1)
                tensors[base + "in_proj_qkv.weight" + suffix] = np.concatenate([flat(q), flat(k), flat(v)])
                tensors[base + "in_proj_z.weight" + suffix] = flat(z)
            if base + "in_proj_ba.weight" + suffix in tensors:
                ba = tensors.pop(base + "in_proj_ba.weight" + suffix).reshape(h.key_heads, 2 * r, -1)
                tensors[base + "in_proj_b.weight" + suffix] = flat(ba[:, :r])
                tensors[base + "in_proj_a.weight" + suffix] = flat(ba[:, r:])
