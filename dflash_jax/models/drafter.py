"""The DFlash drafter (z-lab format), the DSpark drafter and the DFlash2 drafter in Flax NNX.

One drafter forward proposes a whole block: queries come from ``[anchor, MASK, …]`` embedded with the
*target's* embeddings; keys/values come from the injected context (projected target features of committed
positions, kept in a per-layer cache) plus the block itself; logits come from the *target's* lm_head.
Context K/V are computed once per committed position by :meth:`DFlashDrafter.context_kv` ("materialized")
and written into the drafter's :class:`~dflash_jax.models.target.KVCache`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from dflash_jax.config import ConfigError, DrafterConfig
from dflash_jax.kernels.attention import draft_attention, read_after
from dflash_jax.kernels.top_k import head_top_k, top_k
from dflash_jax.models.layers import MLP, Dense, Embed, RMSNorm, Rope, apply_rope, matmul, normal_init
from dflash_jax.models.target import KVCache, write_rows
from dflash_jax.tuning import Kernels


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

    def kv(self, x: Float[Array, "B T D"], cos, sin, kernels: Kernels = Kernels()) -> tuple[jax.Array, jax.Array]:
        """K (k_norm, RoPE) and V for rows ``x`` — context rows are NOT passed through input_layernorm."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x, kernels).reshape(b, t, self.k, self.h))
        return apply_rope(k, cos, sin), self.v_proj(x, kernels).reshape(b, t, self.k, self.h)

    def __call__(self, x_hat, positions, cos, sin, ctx_k, ctx_v, ctx_len, *, kernels: Kernels):
        b, t, _ = x_hat.shape
        q = apply_rope(self.q_norm(self.q_proj(x_hat, kernels).reshape(b, t, self.n, self.h)), cos, sin)
        blk_k, blk_v = self.kv(x_hat, cos, sin, kernels)
        ctx_k, ctx_v = read_after(x_hat, ctx_k, ctx_v, kernels)
        out = draft_attention(q, ctx_k, ctx_v, blk_k, blk_v, positions, ctx_len, causal=self.causal,
                              window=self.window, kernels=kernels)
        return self.o_proj(out.reshape(b, t, self.n * self.h), kernels)


class DraftLayer(nnx.Module):
    def __init__(self, dc: DrafterConfig, idx: int, *, dtype, rngs: nnx.Rngs):
        c = dc.layers
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.self_attn = DraftAttention(dc, idx, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cos, sin, ctx_k, ctx_v, ctx_len, *, kernels: Kernels):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, ctx_k, ctx_v, ctx_len, kernels=kernels)
        return x + self.mlp(self.post_attention_layernorm(x), kernels)

    def sublayer(self, name: str, h: Float[Array, "B T D"], fn, block: int,
                 kernels: Kernels = Kernels()) -> Float[Array, "B T D"]:
        """The residual branch of sublayer ``name`` (``"attention"`` or ``"mlp"``) on its normed input ``h``:
        ``fn(h)`` here; a kind that wraps its sublayers (DFlash2's convolutions) overrides this. Training runs
        the layer through it (:func:`dflash_jax.train.objective.drafter_forward_blocks`), with blocks of
        ``block`` positions laid end to end along T."""
        return fn(h)


class TokenMap(nnx.Variable):
    """Draft-vocabulary id → target id (a reduced draft vocabulary); not a trained parameter."""


class DraftHead(nnx.Variable):
    """The target's LM-head rows of a reduced draft vocabulary [Vd, D]: a copy of target weights, neither
    trained nor exported."""


class DFlashDrafter(nnx.Module):
    """z-lab ``DFlashDraftModel``: fc, hidden_norm, Qwen3-style layers, norm. No embeddings, no lm_head."""

    # Checkpoint tensors that are no parameter of the module (the loader reads them itself, e.g. ``d2t``).
    checkpoint_extras: tuple[str, ...] = ()
    layer_class: type[DraftLayer] = DraftLayer  # the decoder layer (a kind may add to it: DFlash2's convolutions)

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c = cfg.layers
        self.config = cfg
        self.fc = Dense(cfg.num_features * c.hidden_size, c.hidden_size, bias=False, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([self.layer_class(cfg, i, dtype=dtype, rngs=rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.rope = Rope(c)
        # A reduced draft vocabulary (:func:`dflash_jax.loading.restrict_draft_vocab`; a DSpark checkpoint's
        # ``d2t``): draft id → target id, and the target's LM-head rows of those ids, so the drafts' head reads
        # Vd rows instead of V. None = drafts over the whole target vocabulary.
        self.d2t: TokenMap | None = nnx.data(None)
        self.draft_head: DraftHead | None = nnx.data(None)

    @property
    def dtype(self):
        return self.norm.weight[...].dtype  # the compute dtype (``fc`` may be quantized)

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
        kernels: Kernels = Kernels(),
    ) -> Float[Array, "B L D"]:
        """Draft hidden states (after the final norm) for a block at ``positions``, context ``< ctx_len``."""
        cos, sin = self.rope(positions)
        x = block_embeds.astype(self.dtype) * self.config.input_embedding_scale
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, cache.k[i], cache.v[i], ctx_len, kernels=kernels)
        return self.norm(x)

    def draft_logits(self, hidden: Float[Array, "*b D"], target, kernels: Kernels = Kernels()
                     ) -> Float[Array, "*b Vd"]:
        """Target lm_head on draft hidden states, with z-lab's optional multiplier / soft-capping, over the
        draft vocabulary (Vd = V without one; ids back to the target's with :meth:`to_target_ids`)."""
        return self.scale_logits(self.head_logits(hidden, target, kernels))

    def head_logits(self, hidden: Float[Array, "*b D"], target, kernels: Kernels = Kernels()
                    ) -> Float[Array, "*b Vd"]:
        """The target's lm_head on draft hidden states over the draft vocabulary, before :meth:`scale_logits`
        (a quantized target head through the kernel op under ``kernels``, as the target's own logits)."""
        if self.draft_head is not None:
            return jnp.einsum("...d,vd->...v", hidden, self.draft_head[...], preferred_element_type=jnp.float32)
        logits = target.logits(hidden, kernels)
        return logits if self.d2t is None else jnp.take(logits, self.d2t[...], axis=-1)

    def head_weight(self, target) -> tuple[jax.Array, bool] | None:
        """What :meth:`head_logits` multiplies by when it is the target's whole, unquantized head (no draft head,
        no reduced vocabulary): ``target.head_weight()``; else None. A kernel that forms the logits itself (the
        op ``head_top_k``) reads it; a subclass with another :meth:`head_logits` returns None."""
        return target.head_weight() if self.draft_head is None and self.d2t is None else None

    def scale_logits(self, logits: Float[Array, "*b n"]) -> Float[Array, "*b n"]:
        """z-lab's ``output_multiplier``, then ``final_logit_softcapping`` if set."""
        logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return jnp.tanh(logits / cap) * cap if cap else logits

    def to_target_ids(self, draft_ids: Int[Array, "*b"]) -> Int[Array, "*b"]:
        return draft_ids if self.d2t is None else jnp.take(self.d2t[...], draft_ids)

    def keep_draft_columns(self, ids: Int[Array, "Vd"]) -> None:
        """Drafting over target ids ``ids`` only: weights over the draft vocabulary keep those columns (none
        here: the LM head rows and ``d2t`` are set by :func:`dflash_jax.loading.restrict_draft_vocab`)."""

    def to_target_probs(self, q: Float[Array, "*b Vd"]) -> Float[Array, "*b V"]:
        """A draft-vocabulary distribution as one over the target vocabulary (zero outside the draft vocab)."""
        if self.d2t is None:
            return q
        full = jnp.zeros((*q.shape[:-1], self.config.layers.vocab_size), q.dtype)
        return full.at[..., self.d2t[...]].set(q)


# --------------------------------------------------------------------------------------------------
# DSpark (SPEC §7): the DFlash trunk plus a sequential head and a confidence head
# --------------------------------------------------------------------------------------------------

class MarkovHead(nnx.Module):
    """``bias(prev) = W2 · W1[prev]``: the previous token's contribution to the next draft's logits
    (``markov_w1`` an embedding [V, r] over the target vocabulary, ``markov_w2`` a linear r → V_draft)."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int, *, dtype, rngs: nnx.Rngs):
        self.markov_w1 = Embed(vocab, rank, dtype=dtype, rngs=rngs)
        self.markov_w2 = Dense(rank, draft_vocab, bias=False, dtype=dtype, rngs=rngs)

    def embed(self, prev: Int[Array, "*b"]) -> Float[Array, "*b R"]:
        return self.markov_w1(prev)

    def bias(self, e: Float[Array, "*b R"]) -> Float[Array, "*b Vd"]:
        return matmul(e, self.markov_w2.kernel[...], preferred_element_type=jnp.float32)


class ConfidenceHead(nnx.Module):
    """``z = w · [h ; W1[prev]] + b``: the logit of the probability that this draft passes verification."""

    def __init__(self, d: int, rank: int, *, dtype, rngs: nnx.Rngs):
        self.proj = Dense(d + rank, 1, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, h: Float[Array, "*b D"], e: Float[Array, "*b R"]) -> Float[Array, "*b"]:
        x = jnp.concatenate([h, e.astype(h.dtype)], axis=-1)
        return self.proj(x)[..., 0].astype(jnp.float32)


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter: the DFlash trunk run over ``[anchor, MASK × (γ-1)]`` gives per-position base logits
    ``U_k`` (its output at the anchor predicts the first draft); the Markov head adds ``W2·W1[x_{k-1}]`` left
    to right (``x_{-1}`` = the anchor); the confidence head scores each draft,
    ``c_k = σ(z_k / T_k)`` with ``z_k = w·[h_k ; W1[x_{k-1}]] + b`` (``h_k`` the trunk's final-normed hidden
    state, the one the lm_head reads; ``T_k`` the STS temperatures, 1 until fitted).

    The left-to-right scan itself is the kind's drafting (:class:`dflash_jax.drafters.dspark.DSpark`); this
    module gives its pieces, which training also uses teacher-forced.
    """

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        c = cfg.layers
        self.markov_head = MarkovHead(c.vocab_size, cfg.draft_vocab, cfg.markov_rank, dtype=dtype, rngs=rngs)
        self.confidence_head = (ConfidenceHead(c.hidden_size, cfg.markov_rank, dtype=dtype, rngs=rngs)
                                if cfg.confidence_head else None)
        if cfg.draft_vocab_size:
            self.d2t = TokenMap(jnp.arange(cfg.draft_vocab, dtype=jnp.int32))

    checkpoint_extras = ("d2t", "draft_id_to_target_id", "t2d")

    def keep_draft_columns(self, ids: Int[Array, "Vd"]) -> None:
        """The Markov head's bias is over the draft vocabulary: keep the columns of target ids ``ids`` (in
        place, on a copy the caller made; the config then says the reduced ``draft_vocab_size``)."""
        self.config = dataclasses.replace(self.config, draft_vocab_size=int(ids.shape[0])).validate()
        w2 = self.markov_head.markov_w2.kernel
        w2.set_value(jnp.take(w2[...], jnp.asarray(ids, jnp.int32), axis=1))

    def base_logits(self, hidden: Float[Array, "B G D"], target, kernels: Kernels = Kernels()
                    ) -> Float[Array, "B G Vd"]:
        """``U_k``: the target's lm_head on the trunk's hidden states, over the draft vocabulary."""
        return self.draft_logits(hidden, target, kernels)

    def temperatures(self, g: int) -> Float[Array, "G"]:
        temps = self.config.confidence_temperatures
        return jnp.asarray(temps[:g] if temps else (1.0,) * g, jnp.float32)


# --------------------------------------------------------------------------------------------------
# DFlash2: the DFlash trunk with a grouped dynamic convolution around each sublayer, and a candidate selector
# --------------------------------------------------------------------------------------------------

class GroupedConv(nnx.Module):
    """A grouped dynamic depthwise convolution along the block, causal and confined to it: for block position i
    (``i mod L``, L the block length) and channel c of group g(c) = c // group_size,
    ``out[i, c] = Σ_{t < W, t ≤ i mod L} (base_kernel[s, t, c] + δ_s[i, t, g(c)]) · x[i − t, c]``.
    Side s = 0 convolves a sublayer's input, s = 1 its output; the deltas of both sides come from one projection
    of the sublayer's input, ``kernel_projection`` (D → 2·W·G, no bias, read as [2, W, G]).

    ``base_kernel`` starts as the identity (tap 0 = 1): the convolution then only adds the deltas."""

    def __init__(self, d: int, taps: int, group_size: int, *, dtype, rngs: nnx.Rngs):
        self.taps, self.group_size, self.groups = taps, group_size, d // group_size
        self.base_kernel = nnx.Param(jnp.zeros((2, taps, d), dtype).at[:, 0].set(1))
        self.kernel_projection = Dense(d, 2 * taps * self.groups, bias=False, dtype=dtype, rngs=rngs)

    def deltas(self, x: Float[Array, "B T D"], kernels: Kernels = Kernels()) -> Float[Array, "B T 2 W G"]:
        b, t, _ = x.shape
        delta = self.kernel_projection(x, kernels).astype(jnp.float32)
        return delta.reshape(b, t, 2, self.taps, self.groups)

    def __call__(self, x: Float[Array, "B T D"], delta: Float[Array, "B T W G"], side: int, block: int
                 ) -> Float[Array, "B T D"]:
        b, t, d = x.shape
        xs = x.astype(jnp.float32).reshape(b, t, self.groups, self.group_size)
        base = self.base_kernel[...][side].astype(jnp.float32).reshape(self.taps, self.groups, self.group_size)
        coef = base[None, None] + delta[..., None]  # [B, T, W, G, group_size]
        within = jnp.arange(t) % block  # position inside its block: taps never reach the block before
        out = coef[:, :, 0] * xs
        for tap in range(1, min(self.taps, t)):
            shifted = jnp.pad(xs[:, : t - tap], ((0, 0), (tap, 0), (0, 0), (0, 0)))  # x[i - tap]
            out = out + jnp.where((within >= tap)[None, :, None, None], coef[:, :, tap] * shifted, 0.0)
        return out.reshape(b, t, d).astype(x.dtype)


class DFlash2Layer(DraftLayer):
    """A DFlash layer whose attention and MLP sublayers are each wrapped in a :class:`GroupedConv`: the normed
    input convolved (side 0) into the sublayer, its output convolved (side 1) into the residual, both sides'
    deltas from the normed input. The block's own K/V come from the convolved input; the context's are not
    convolved (:meth:`DFlashDrafter.context_kv` is unchanged)."""

    def __init__(self, dc: DrafterConfig, idx: int, *, dtype, rngs: nnx.Rngs):
        super().__init__(dc, idx, dtype=dtype, rngs=rngs)
        d = dc.layers.hidden_size
        self.attention_conv = GroupedConv(d, dc.conv_kernel_size, dc.conv_group_size, dtype=dtype, rngs=rngs)
        self.mlp_conv = GroupedConv(d, dc.conv_kernel_size, dc.conv_group_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cos, sin, ctx_k, ctx_v, ctx_len, *, kernels: Kernels, block: int | None = None):
        block = block or x.shape[1]  # the decode loop's trunk call is one block per row
        attend = lambda h: self.self_attn(h, positions, cos, sin, ctx_k, ctx_v, ctx_len, kernels=kernels)  # noqa: E731
        x = x + self.sublayer("attention", self.input_layernorm(x), attend, block, kernels)
        return x + self.sublayer("mlp", self.post_attention_layernorm(x), lambda h: self.mlp(h, kernels), block,
                                 kernels)

    def sublayer(self, name, h, fn, block, kernels=Kernels()):
        """``fn`` between the two sides of the sublayer's convolution (``attention_conv`` / ``mlp_conv``): the
        deltas of both from ``h``, side 0 on ``h``, side 1 on ``fn``'s output."""
        conv = self.attention_conv if name == "attention" else self.mlp_conv
        delta = conv.deltas(h, kernels)
        return conv(fn(conv(h, delta[:, :, 0], 0, block)), delta[:, :, 1], 1, block)


class CandidateSelector(nnx.Module):
    """Scores the K × K edges between the candidates of adjacent block positions:
    ``edge[k, p, c] = unary[k, c] + Σ_r P[a_p, r] · (W_h · h_k)[r] · S[b_c, r]`` — ``b_c`` the c-th candidate of
    position k, ``a_p`` the p-th candidate of position k − 1 (for k = 0: the anchor, every row alike);
    ``P`` = ``predecessor_codebook``, ``S`` = ``successor_codebook`` (both [V, R], target ids),
    ``W_h`` = ``hidden_projection`` (D → R, no bias), ``h_k`` the trunk's final-normed hidden state."""

    def __init__(self, vocab: int, d: int, rank: int, *, dtype, rngs: nnx.Rngs):
        self.predecessor_codebook = nnx.Param(normal_init(rngs, (vocab, rank), rank ** -0.25, dtype))
        self.successor_codebook = nnx.Param(normal_init(rngs, (vocab, rank), rank ** -0.25, dtype))
        self.hidden_projection = Dense(d, rank, bias=False, dtype=dtype, rngs=rngs)

    def edge_scores(self, ids: Int[Array, "B G K"], unary: Float[Array, "B G K"], hidden: Float[Array, "B G D"],
                    anchor: Int[Array, "B"], kernels: Kernels = Kernels()) -> Float[Array, "B G K K"]:
        """``[b, k, p, c]``: the score of candidate c at position k after candidate p at position k − 1."""
        b, _, k = ids.shape
        prev = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], (b, 1, k)), ids[:, :-1]], axis=1)
        pred = jnp.take(self.predecessor_codebook[...], prev, axis=0).astype(jnp.float32)  # [B, G, K, R]
        succ = jnp.take(self.successor_codebook[...], ids, axis=0).astype(jnp.float32)  # [B, G, K, R]
        h = self.hidden_projection(hidden, kernels).astype(jnp.float32)  # [B, G, R]
        return unary.astype(jnp.float32)[:, :, None, :] + jnp.einsum("bgpr,bgr,bgcr->bgpc", pred, h, succ)

    def candidate_scores(self, ids: Int[Array, "*b K"], unary: Float[Array, "*b K"], hidden: Float[Array, "*b D"],
                         prev: Int[Array, "*b"], kernels: Kernels = Kernels()) -> Float[Array, "*b K"]:
        """One row of :meth:`edge_scores`: the scores of candidates ``ids`` after the single token ``prev``
        (training feeds the true previous token, teacher-forced)."""
        pred = jnp.take(self.predecessor_codebook[...], prev, axis=0).astype(jnp.float32)  # [*b, R]
        succ = jnp.take(self.successor_codebook[...], ids, axis=0).astype(jnp.float32)  # [*b, K, R]
        h = self.hidden_projection(hidden, kernels).astype(jnp.float32)  # [*b, R]
        return unary.astype(jnp.float32) + jnp.einsum("...r,...cr->...c", pred * h, succ)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter: the DFlash trunk over ``[anchor, MASK × (L−1)]`` with :class:`DFlash2Layer` layers
    (``input_embedding_scale`` scales its input embeddings, as for DFlash); positions 1 … L−1 each propose their
    top-K tokens of the target's LM head (:meth:`candidates`) and the :class:`CandidateSelector` scores the
    edges between adjacent positions' candidates. The walk over those edges is the kind's drafting
    (:class:`dflash_jax.drafters.dflash2.DFlash2`)."""

    layer_class = DFlash2Layer

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        c = cfg.layers
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, cfg.selector_rank, dtype=dtype,
                                                    rngs=rngs)

    def candidates(self, hidden: Float[Array, "*b D"], target, kernels: Kernels = Kernels()
                   ) -> tuple[Int[Array, "*b K"], Float[Array, "*b K"]]:
        """The K best tokens of each position (target ids, best first) and their unary scores: the top-K of the
        LM head's logits (the kernel op :func:`~dflash_jax.kernels.top_k.top_k`), then ``output_multiplier`` and
        soft-capping on the K values."""
        k = self.config.selector_top_k
        head = self.head_weight(target)
        if head is not None:  # the whole target head: the op that may form the logits and their top-K together
            values, ids = head_top_k(hidden, head[0], k, vocab_major=head[1], kernels=kernels)
        else:
            values, ids = top_k(self.head_logits(hidden, target, kernels), k, kernels=kernels)
        return self.to_target_ids(ids.astype(jnp.int32)), self.scale_logits(values)

    def keep_draft_columns(self, ids: Int[Array, "Vd"]) -> None:
        """Nothing is over the draft vocabulary (the codebooks are over target ids); it must hold K tokens."""
        if ids.shape[0] < self.config.selector_top_k:
            raise ConfigError(f"a DFlash2 draft vocabulary needs at least selector_top_k = "
                              f"{self.config.selector_top_k} tokens, got {ids.shape[0]}")


# The module class of each drafter kind (``DrafterConfig.kind``), filled as :mod:`dflash_jax.drafters` registers
# the kinds (the decoding side of a kind is there).
MODULE_CLASSES: dict[str, type[DFlashDrafter]] = {}


def module_class(cfg: DrafterConfig) -> type[DFlashDrafter]:
    """The module class a drafter of config ``cfg`` is built from."""
    if cfg.kind not in MODULE_CLASSES:
        raise ConfigError(f"drafter kind {cfg.kind!r} has no module class (registered: {tuple(MODULE_CLASSES)})")
    return MODULE_CLASSES[cfg.kind]
