"""The DFlash drafter (z-lab format) in Flax NNX.

One drafter forward proposes a whole block: queries come from ``[anchor, MASK, …]`` embedded with the
*target's* embeddings; keys/values come from the injected context (projected target features of committed
positions, kept in a per-layer cache) plus the block itself; logits come from the *target's* lm_head.
Context K/V are computed once per committed position by :meth:`DFlashDrafter.context_kv` ("materialized")
and written into the drafter's :class:`~dflash_jax.models.target.KVCache`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax import attention
from dflash_jax.config import DrafterConfig
from dflash_jax.models.layers import MLP, Dense, RMSNorm, Rope, apply_rope
from dflash_jax.models.target import KVCache, write_rows


class DraftAttention(nnx.Module):
    def __init__(self, dc: DrafterConfig, idx: int, *, dtype, rngs: nnx.Rngs):
        c = dc.layers
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Dense(d, n * h, bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Dense(d, k * h, bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Dense(d, k * h, bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Dense(n * h, d, bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(h, eps=c.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(h, eps=c.rms_norm_eps, dtype=dtype)
        self.n, self.k, self.h = n, k, h
        self.causal, self.window = dc.layer_causal(idx), dc.layer_window(idx)

    def kv(self, x: Float[Array, "B T D"], cos, sin) -> tuple[jax.Array, jax.Array]:
        """K (k_norm, RoPE) and V for rows ``x`` — context rows are NOT passed through input_layernorm."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.k, self.h))
        return apply_rope(k, cos, sin), self.v_proj(x).reshape(b, t, self.k, self.h)

    def __call__(self, x_hat, positions, cos, sin, ctx_k, ctx_v, ctx_len, *, impl: str):
        b, t, _ = x_hat.shape
        q = apply_rope(self.q_norm(self.q_proj(x_hat).reshape(b, t, self.n, self.h)), cos, sin)
        blk_k, blk_v = self.kv(x_hat, cos, sin)
        out = attention.draft_attention(q, ctx_k, ctx_v, blk_k, blk_v, positions, ctx_len,
                                        causal=self.causal, window=self.window, impl=impl)
        return self.o_proj(out.reshape(b, t, self.n * self.h))


class DraftLayer(nnx.Module):
    def __init__(self, dc: DrafterConfig, idx: int, *, dtype, rngs: nnx.Rngs):
        c = dc.layers
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.self_attn = DraftAttention(dc, idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cos, sin, ctx_k, ctx_v, ctx_len, *, impl: str):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, ctx_k, ctx_v, ctx_len, impl=impl)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nnx.Module):
    """z-lab ``DFlashDraftModel``: fc, hidden_norm, Qwen3-style layers, norm. No embeddings, no lm_head."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c = cfg.layers
        self.config = cfg
        self.fc = Dense(cfg.num_features * c.hidden_size, c.hidden_size, bias=False, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DraftLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.rope = Rope(c)

    @property
    def dtype(self):
        return self.fc.kernel[...].dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.config.layers
        return KVCache.zeros(c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, self.dtype)

    def project_context(self, features: Float[Array, "B T F"]) -> Float[Array, "B T D"]:
        return self.hidden_norm(self.fc(features.astype(self.dtype)))

    def context_kv(self, features: Float[Array, "B T F"], positions: Int[Array, "B T"]):
        """Per-layer context (K, V) for feature rows at ``positions`` (SPEC §2.5)."""
        ctx = self.project_context(features)
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def materialize(self, cache: KVCache, features: Float[Array, "B T F"], positions: Int[Array, "B T"]) -> KVCache:
        """Write the context K/V of ``T`` consecutive positions per row (from ``positions[:, 0]``)."""
        kvs = self.context_kv(features, positions)
        start = positions[:, 0]
        return KVCache(tuple(write_rows(c, k, start) for c, (k, _) in zip(cache.k, kvs)),
                       tuple(write_rows(c, v, start) for c, (_, v) in zip(cache.v, kvs)))

    def __call__(
        self,
        block_embeds: Float[Array, "B L D"],
        positions: Int[Array, "B L"],
        cache: KVCache,
        ctx_len: Int[Array, "B"],
        *,
        impl: str = "xla",
    ) -> Float[Array, "B L D"]:
        """Draft hidden states (after the final norm) for a block at ``positions``, context ``< ctx_len``."""
        cos, sin = self.rope(positions)
        x = block_embeds.astype(self.dtype) * self.config.input_embedding_scale
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, cache.k[i], cache.v[i], ctx_len, impl=impl)
        return self.norm(x)

    def draft_logits(self, hidden: Float[Array, "B L D"], target) -> Float[Array, "B L V"]:
        """Target lm_head on draft hidden states, with z-lab's optional multiplier / soft-capping."""
        logits = target.logits(hidden) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return jnp.tanh(logits / cap) * cap if cap else logits
